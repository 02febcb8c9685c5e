// The chat page: one conversation over the websocket protocol at /ws. Every
// `generate` sends the whole history; at most one answer is in flight. The
// answer remembers its request_id and the last seq it showed, so after a
// dropped socket (or a reload of the page: the state is kept in
// sessionStorage) it `resume`s and goes on in place. Model output and server
// text are only ever set as text (textContent, Text nodes), never as HTML.
"use strict";

(function () {
  const { Connection, bindKeyInput, setBanner } = window.Orcapod;
  const STATE_STORAGE = "orcapod.chat"; // sessionStorage: survives a reload of this tab
  const SETTINGS_STORAGE = "orcapod.chatSettings"; // localStorage: temperature, max tokens
  const FINISH_TEXT = { stop: "finished", length: "max tokens reached", cancelled: "cancelled" };

  const byId = (id) => document.getElementById(id);
  const log = byId("log");
  const empty = byId("empty");
  const prompt = byId("prompt");
  const sendButton = byId("send");
  const stopButton = byId("stop");
  const newChatButton = byId("new-chat");
  const banner = byId("banner");
  const settings = byId("settings");
  const keyInput = byId("api-key");
  const temperatureInput = byId("temperature");
  const maxTokensInput = byId("max-tokens");

  // What every generate sends, in order; an answer joins it once it is done.
  // Entries: {role, content, meta} (meta: the line shown under an answer).
  let conversation = [];
  // The answer in flight, or null: {id, requestId, lastSeq, text, sent,
  // cancelWanted, frame} (kept across reloads) and its elements.
  let answer = null;
  let scrollScheduled = false;

  const connection = new Connection("/ws", { onOpen, onFrame, onStatus });

  // --- elements --------------------------------------------------------------------

  function addMessage(role, content) {
    empty.hidden = true;
    const element = document.createElement("article");
    element.className = "message " + role;
    const text = document.createElement("div");
    text.className = "text";
    const textNode = document.createTextNode(content);
    text.append(textNode);
    const meta = document.createElement("div");
    meta.className = "meta";
    element.append(text, meta);
    log.append(element);
    scrollToEnd(true);
    return { element, textNode, meta };
  }

  function addNotice(text) {
    empty.hidden = true;
    const element = document.createElement("p");
    element.className = "notice error";
    element.textContent = text;
    log.append(element);
    scrollToEnd(true);
  }

  function nearEnd() {
    return log.scrollHeight - log.scrollTop - log.clientHeight < 48;
  }

  // At most one scroll (and one layout read) per frame, however many tokens come.
  function scrollToEnd(force) {
    if (scrollScheduled) return;
    scrollScheduled = true;
    const stick = force || nearEnd();
    requestAnimationFrame(() => {
      scrollScheduled = false;
      if (stick) log.scrollTop = log.scrollHeight;
    });
  }

  function updateButtons() {
    const busy = answer !== null;
    sendButton.disabled = busy;
    stopButton.disabled = !busy || answer.cancelWanted;
    newChatButton.disabled = busy;
  }

  // --- the answer's life ------------------------------------------------------------

  function newId() {
    return "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function generateFrame(id) {
    const frame = {
      type: "generate",
      id,
      messages: conversation.map(({ role, content }) => ({ role, content })),
    };
    const temperature = parseFloat(temperatureInput.value);
    if (Number.isFinite(temperature)) frame.temperature = temperature;
    const maxTokens = parseInt(maxTokensInput.value, 10);
    if (Number.isFinite(maxTokens)) frame.max_tokens = maxTokens;
    return frame;
  }

  function send() {
    const text = prompt.value.trim();
    if (!text || answer !== null) return;
    prompt.value = "";
    conversation.push({ role: "user", content: text });
    const user = addMessage("user", text);
    const id = newId();
    answer = {
      id,
      requestId: null,
      lastSeq: -1,
      text: "",
      sent: false,
      cancelWanted: false,
      frame: generateFrame(id),
      userElement: user.element,
      ...showAnswer(""),
    };
    answer.sent = connection.send(answer.frame); // else on the next open
    save();
    updateButtons();
  }

  function showAnswer(text) {
    const shown = addMessage("assistant", text);
    shown.element.dataset.state = "streaming";
    shown.meta.textContent = "…";
    return shown;
  }

  function stop() {
    if (answer === null || answer.cancelWanted) return;
    answer.cancelWanted = true;
    if (!answer.sent) {
      fail("cancelled before it was sent", "cancelled");
      return;
    }
    connection.send({ type: "cancel", id: answer.id }); // else after the resume
    answer.meta.textContent = "stopping…";
    updateButtons();
  }

  function onOpen() {
    if (answer === null) return;
    if (!answer.sent) {
      answer.sent = connection.send(answer.frame);
    } else if (answer.requestId !== null) {
      connection.send({
        type: "resume",
        request_id: answer.requestId,
        after_seq: answer.lastSeq,
        id: answer.id,
      });
      if (answer.cancelWanted) connection.send({ type: "cancel", id: answer.id });
    } else {
      // Sent, but its `accepted` never came: there is no request_id to resume.
      fail("the connection dropped before the request was accepted; send it again");
    }
  }

  function onFrame(frame) {
    const mine = answer !== null && frame.id === answer.id;
    switch (frame.type) {
      case "accepted":
        if (mine) {
          answer.requestId = String(frame.request_id);
          save();
        }
        break;
      case "token":
        // A resume replays only what came after lastSeq; the check keeps a
        // token from showing twice whatever arrives.
        if (mine && frame.seq > answer.lastSeq) {
          answer.lastSeq = frame.seq;
          const text = String(frame.text);
          answer.text += text;
          answer.textNode.appendData(text);
          scrollToEnd(false);
        }
        break;
      case "done":
        if (mine) finish(frame);
        break;
      case "error":
        if (mine) fail(`${frame.code}: ${frame.message}`);
        else addNotice(`${frame.code}: ${frame.message}`);
        break;
      default:
        break; // a frame type this page does not know: nothing to show
    }
  }

  function describe(done) {
    const parts = [];
    const timings = done.timings || {};
    const ttftMs = timings.ttft_ms;
    const numTokens = done.usage ? done.usage.completion_tokens : 0;
    if (typeof ttftMs === "number") parts.push(`TTFT ${Math.round(ttftMs)} ms`);
    const decodeS = ((timings.total_ms || 0) - (ttftMs || 0)) / 1000;
    if (numTokens > 1 && decodeS > 0) {
      parts.push(`${((numTokens - 1) / decodeS).toFixed(1)} tokens/s`);
    }
    parts.push(`${numTokens} token${numTokens === 1 ? "" : "s"}`);
    parts.push(FINISH_TEXT[done.finish_reason] || String(done.finish_reason));
    return parts.join(" · ");
  }

  function finish(done) {
    const meta = describe(done);
    answer.element.dataset.state = "done";
    answer.element.dataset.finish = String(done.finish_reason);
    answer.meta.textContent = meta;
    if (answer.text) {
      conversation.push({ role: "assistant", content: answer.text, meta });
    } else {
      // Nothing was said: the question leaves the conversation too.
      conversation.pop();
      answer.userElement.classList.add("dropped");
    }
    answer = null;
    save();
    updateButtons();
  }

  // The answer ends without a `done`: its question leaves the conversation.
  function fail(text, finishReason = "error") {
    answer.element.dataset.state = "error";
    answer.element.dataset.finish = finishReason;
    answer.element.classList.add("dropped");
    answer.userElement.classList.add("dropped");
    answer.meta.textContent = text;
    answer.meta.classList.add("error");
    conversation.pop();
    answer = null;
    save();
    updateButtons();
  }

  function onStatus(kind, text) {
    if (kind === "open") setBanner(banner, "info", "");
    else if (kind === "reconnecting") setBanner(banner, "warn", text);
    else {
      setBanner(banner, "error", text);
      settings.open = true;
    }
  }

  // --- kept state -------------------------------------------------------------------

  function save() {
    const kept = answer && {
      id: answer.id,
      requestId: answer.requestId,
      lastSeq: answer.lastSeq,
      text: answer.text,
      sent: answer.sent,
      cancelWanted: answer.cancelWanted,
      frame: answer.frame,
    };
    try {
      sessionStorage.setItem(STATE_STORAGE, JSON.stringify({ conversation, answer: kept }));
    } catch {
      // storage full or disabled: a reload starts afresh
    }
  }

  function restore() {
    let kept = null;
    try {
      kept = JSON.parse(sessionStorage.getItem(STATE_STORAGE) || "null");
    } catch {
      kept = null;
    }
    if (!kept || !Array.isArray(kept.conversation)) return;
    conversation = kept.conversation.filter(
      (entry) => entry && typeof entry.role === "string" && typeof entry.content === "string",
    );
    let lastUser = null;
    for (const entry of conversation) {
      const shown = addMessage(entry.role, entry.content);
      if (entry.role === "user") lastUser = shown.element;
      if (typeof entry.meta === "string") {
        shown.meta.textContent = entry.meta;
        shown.element.dataset.state = "done";
      }
    }
    const saved = kept.answer;
    if (saved && typeof saved.id === "string" && lastUser !== null) {
      answer = { ...saved, userElement: lastUser, ...showAnswer(String(saved.text || "")) };
      answer.text = String(saved.text || "");
    }
  }

  function loadSettings() {
    try {
      const kept = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
      if (typeof kept.temperature === "string") temperatureInput.value = kept.temperature;
      if (typeof kept.maxTokens === "string") maxTokensInput.value = kept.maxTokens;
    } catch {
      // nothing kept: the defaults of the page
    }
  }

  function saveSettings() {
    try {
      const kept = { temperature: temperatureInput.value, maxTokens: maxTokensInput.value };
      localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(kept));
    } catch {
      // storage disabled: the settings last as long as the page
    }
  }

  // --- wiring -----------------------------------------------------------------------

  byId("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  stopButton.addEventListener("click", stop);
  newChatButton.addEventListener("click", () => {
    if (answer !== null) return;
    conversation = [];
    log.replaceChildren(empty);
    empty.hidden = false;
    save();
  });
  temperatureInput.addEventListener("change", saveSettings);
  maxTokensInput.addEventListener("change", saveSettings);
  bindKeyInput(keyInput, (key) => connection.setKey(key));
  // A reload or a closed tab: keep the answer so far (text up to lastSeq) to resume.
  window.addEventListener("pagehide", save);
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "hidden") save();
  });

  loadSettings();
  restore();
  updateButtons();
  connection.start();
  prompt.focus();

  // For the browser tests and the console: what a frame from the socket does,
  // and a dropped connection.
  window.orcapodChat = { onFrame, dropConnection: () => connection.drop() };
})();
