// What both pages share: the API key (kept in localStorage, sent as the
// `bearer.<key>` subprotocol), the status banner, and one websocket to this
// gateway that reconnects with backoff. A browser never learns a refused
// handshake's status, so a socket that fails to open asks /v1/models (same key)
// whether the key is the reason. See README.md, "The protocols".
"use strict";

(function () {
  const KEY_STORAGE = "orcapod.apiKey";
  const FIRST_BACKOFF_MS = 500;
  const MAX_BACKOFF_MS = 10000;
  // A subprotocol is an HTTP token (RFC 7230): a key with other characters cannot travel in one.
  const TOKEN_CHARS = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

  function loadKey() {
    try {
      return localStorage.getItem(KEY_STORAGE) || "";
    } catch {
      return ""; // storage disabled: the key lives only in the field
    }
  }

  function saveKey(key) {
    try {
      if (key) localStorage.setItem(KEY_STORAGE, key);
      else localStorage.removeItem(KEY_STORAGE);
    } catch {
      // storage disabled: nothing to keep
    }
  }

  /** Fill `input` with the kept key; call `onChange(key)` when the user changes it
   * (here, or in another tab of the same gateway). */
  function bindKeyInput(input, onChange) {
    input.value = loadKey();
    input.addEventListener("change", () => {
      const key = input.value.trim();
      input.value = key;
      saveKey(key);
      onChange(key);
    });
    window.addEventListener("storage", (event) => {
      if (event.key !== KEY_STORAGE) return;
      input.value = event.newValue || "";
      onChange(input.value);
    });
  }

  /** Show `text` in the banner (kind: "info", "warn" or "error"); no text hides it. */
  function setBanner(element, kind, text) {
    element.hidden = !text;
    element.className = "banner " + kind;
    element.textContent = text || "";
  }

  function socketUrl(path) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return scheme + "//" + location.host + path;
  }

  /**
   * One websocket at `path` that reconnects after any close, waiting 0.5 s,
   * then twice as long each time up to 10 s, until it opens again. Handlers:
   * onOpen() (optional), onFrame(object) and onStatus(kind, text), with kind
   * "open" (text empty), "reconnecting" (a close, waiting to try again) or
   * "refused" (the key: it waits for a new one, see setKey).
   */
  class Connection {
    constructor(path, handlers) {
      this.path = path;
      this.handlers = handlers;
      this.key = loadKey();
      this.socket = null;
      this.backoffMs = FIRST_BACKOFF_MS;
      this.timer = null;
      this.generation = 0; // bumped by every connect: late events of an old socket are ignored
    }

    get isOpen() {
      return this.socket !== null && this.socket.readyState === WebSocket.OPEN;
    }

    start() {
      this._connect();
    }

    /** A new key: drop the socket and connect with it now. */
    setKey(key) {
      this.key = key;
      this.backoffMs = FIRST_BACKOFF_MS;
      this._connect();
    }

    /** Send `frame` (an object, as JSON); false when no socket is open. */
    send(frame) {
      if (!this.isOpen) return false;
      this.socket.send(JSON.stringify(frame));
      return true;
    }

    /** Close the socket as a network failure would; it reconnects as after one. */
    drop() {
      if (this.socket !== null) this.socket.close(4000, "dropped by the page");
    }

    _connect() {
      clearTimeout(this.timer);
      this.timer = null;
      const generation = ++this.generation;
      if (this.socket !== null) {
        const old = this.socket;
        this.socket = null;
        old.close(1000);
      }
      if (this.key && !TOKEN_CHARS.test(this.key)) {
        this.handlers.onStatus(
          "refused",
          "This API key cannot be sent from a browser: a key may hold only letters, " +
            "digits and !#$%&'*+-.^_`|~",
        );
        return;
      }
      const protocols = this.key ? ["orcapod", "bearer." + this.key] : [];
      const socket = new WebSocket(socketUrl(this.path), protocols);
      this.socket = socket;
      let opened = false;
      socket.onopen = () => {
        if (generation !== this.generation) return;
        opened = true;
        this.backoffMs = FIRST_BACKOFF_MS;
        this.handlers.onStatus("open", "");
        if (this.handlers.onOpen) this.handlers.onOpen();
      };
      socket.onmessage = (event) => {
        if (generation !== this.generation || typeof event.data !== "string") return;
        let frame;
        try {
          frame = JSON.parse(event.data);
        } catch {
          return; // not a frame of the protocol: nothing to show
        }
        this.handlers.onFrame(frame);
      };
      socket.onclose = (event) => {
        if (generation !== this.generation) return;
        this.socket = null;
        // 1008: the server refused the key (revoked); a handshake that failed never opened.
        if (!opened || event.code === 1008) this._diagnose(generation);
        else this._retry(generation);
      };
    }

    async _diagnose(generation) {
      let response;
      try {
        const headers = this.key ? { Authorization: "Bearer " + this.key } : {};
        response = await fetch("/v1/models", { headers, cache: "no-store" });
      } catch {
        response = null; // the gateway is not there: try again later
      }
      if (generation !== this.generation) return;
      if (response !== null && (response.status === 401 || response.status === 403)) {
        let message = "";
        try {
          message = (await response.json()).error.message;
        } catch {
          message = response.statusText;
        }
        if (generation !== this.generation) return;
        const what = this.key ? "The API key was refused" : "This gateway needs an API key";
        this.handlers.onStatus(
          "refused",
          `${what} (HTTP ${response.status}: ${message}). Enter a key in Settings.`,
        );
        return;
      }
      this._retry(generation);
    }

    _retry(generation) {
      const delayMs = this.backoffMs;
      this.backoffMs = Math.min(this.backoffMs * 2, MAX_BACKOFF_MS);
      this.handlers.onStatus(
        "reconnecting",
        `Connection lost: reconnecting… (next try in ${(delayMs / 1000).toFixed(1)} s)`,
      );
      this.timer = setTimeout(() => {
        if (generation === this.generation) this._connect();
      }, delayMs);
    }
  }

  window.Orcapod = { Connection, bindKeyInput, setBanner };
})();
