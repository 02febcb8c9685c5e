"""The multi-turn trace of ``orcapod bench --trace multiturn`` (pure).

C conversations of K turns share one system prompt. Turn k sends the whole
history (the system prompt, every earlier user message and answer) and a new
user message, and only once the answer to turn k - 1 is back: a closed loop,
one request in flight per conversation. With a prefix cache, turn k computes
little more than the previous answer and the new message; without one, the
whole history again. The driver is ``multiturn.py``; what it reports,
``multiturn_report.py``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

WARM_UP_MESSAGE = "Hello! Please reply with one word."

# About 440 tokens through SmolLM2's tokenizer: long enough that recomputing it
# every turn dominates a short turn's prefill.
SYSTEM_PROMPT = (
    "You are Juniper, the support assistant of Northwind Outfitters, a company that sells "
    "outdoor gear, clothing and travel equipment online and in forty shops across Europe. "
    "Your job is to help customers plan trips, choose equipment, understand our policies "
    "and solve problems with their orders. Follow these rules in every answer. "
    "First, be brief: answer in at most three short sentences unless the customer asks "
    "for a list or for step-by-step instructions, and never repeat the question back. "
    "Second, be accurate: if you do not know something, say so plainly and suggest where "
    "the customer can find out, for example the product page, the size guide or a shop "
    "assistant; never invent prices, stock levels, delivery dates or order details. "
    "Third, be safe: when a question touches on mountains, water, weather, cold or heat, "
    "mention the one precaution that matters most, such as checking the forecast, telling "
    "someone the route, carrying enough water or turning back early. Do not give medical "
    "advice beyond first aid basics; for anything more, tell the customer to see a doctor. "
    "Fourth, our policies: customers may return unused items within sixty days with the "
    "receipt; worn footwear can be returned within fourteen days if it hurts; delivery is "
    "free above fifty euros; repairs of tents, jackets and backpacks are free for two years "
    "and cheap after that; members of the Northwind Club get ten percent off and early "
    "access to sales. Fifth, tone: be warm and practical, use plain words, avoid jargon, "
    "and address the customer directly. If the customer is upset, acknowledge it in one "
    "short phrase and move on to the solution. Sixth, recommendations: when you suggest a "
    "product, name the kind of product and the feature that matters, not a brand, and say "
    "who it suits and who it does not. Prefer durable, repairable gear over disposable gear "
    "and mention renting as an option for equipment used once a year. Seventh, privacy: "
    "never ask for card numbers or passwords; an order number and the email address on the "
    "order are enough to look an order up. Finally, end every answer with a short question "
    "that helps the customer take the next step, unless they said goodbye."
)
SUBJECTS = (
    "a three-day hike in the Scottish Highlands",
    "a winter trip to Lapland",
    "a first camping weekend with two small children",
    "a cycling tour along the Danube",
    "a kayak trip on Swedish lakes",
    "climbing in the Dolomites",
    "a beach holiday in Crete",
    "a pilgrimage walk on the Camino de Santiago",
    "a ski week in the Alps",
    "a rainy-season trip to Ireland",
    "a desert trek in Morocco",
    "a canoe trip in Finland",
    "a fishing weekend in Norway",
    "a city break in Prague in January",
    "a trail running race in the Pyrenees",
    "a sailing course on the Baltic",
    "a bird-watching trip to the Danube delta",
    "a hut-to-hut walk in Austria",
    "a wild camping night on Dartmoor",
    "a snowshoe tour in the Black Forest",
    "a long-distance walk along the Portuguese coast",
    "a via ferrata in Slovenia",
    "a family trip to Iceland in summer",
    "a bikepacking trip across the Netherlands",
)
QUESTIONS = (
    "I am planning {subject}. What should I pack first?",
    "Which kind of footwear do you recommend for {subject}?",
    "How warm should my sleeping bag be for {subject}?",
    "What is the one safety precaution I must not forget on {subject}?",
    "Can I rent equipment instead of buying it for {subject}?",
    "How should I dress in layers for {subject}?",
    "What food is light and practical to carry on {subject}?",
    "How heavy should my backpack be for {subject}?",
    "Is a tent necessary for {subject}, or are there alternatives?",
    "What should I do if the weather turns bad during {subject}?",
    "How do I keep my phone charged during {subject}?",
    "What first aid items should I bring on {subject}?",
    "If my new jacket leaks on {subject}, can I return it?",
    "Do club members get a discount on gear for {subject}?",
    "How early should I order so that my gear arrives before {subject}?",
    "What is a common mistake beginners make on {subject}?",
)


@dataclass(frozen=True)
class MultiturnSpec:
    """What to generate: ``num_conversations`` × ``num_turns`` turns, ``max_tokens`` each."""

    num_conversations: int = 8
    num_turns: int = 8
    max_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.num_turns, self.max_tokens) < 1:
            raise ValueError("conversations, turns and max_tokens must be at least 1")


@dataclass(frozen=True)
class Conversation:
    """One conversation's user messages, one per turn (the answers come from the server)."""

    index: int
    user_messages: tuple[str, ...]


@dataclass(frozen=True)
class MultiturnTrace:
    """The conversations of a spec; every one starts with ``system_prompt``."""

    spec: MultiturnSpec
    system_prompt: str
    conversations: tuple[Conversation, ...]


def make_multiturn_trace(spec: MultiturnSpec) -> MultiturnTrace:
    """The trace of ``spec``: the same spec always gives the same trace, and no two
    user messages in it are equal."""
    rng = random.Random(f"multiturn:{spec.seed}")
    subjects = list(SUBJECTS)
    rng.shuffle(subjects)
    conversations = []
    for index in range(spec.num_conversations):
        subject = subjects[index % len(subjects)]
        if index >= len(subjects):  # more conversations than subjects: tell them apart
            subject += f" (group {index // len(subjects) + 1})"
        order = rng.sample(range(len(QUESTIONS)), len(QUESTIONS))
        messages = []
        for turn in range(spec.num_turns):
            message = QUESTIONS[order[turn % len(QUESTIONS)]].format(subject=subject)
            if turn >= len(QUESTIONS):
                message += f" (Asking again, round {turn // len(QUESTIONS) + 1}.)"
            messages.append(message)
        conversations.append(Conversation(index, tuple(messages)))
    return MultiturnTrace(spec, SYSTEM_PROMPT, tuple(conversations))


def turn_messages(
    system_prompt: str, conversation: Conversation, answers: Sequence[str]
) -> list[dict[str, str]]:
    """The messages of turn ``len(answers) + 1``: the system prompt, the history
    (user message and answer of each earlier turn), then this turn's user message."""
    turn = len(answers)
    if turn >= len(conversation.user_messages):
        raise ValueError(f"conversation {conversation.index} has only {turn} turns")
    messages = [{"role": "system", "content": system_prompt}]
    for user_message, answer in zip(conversation.user_messages, answers, strict=False):
        messages += [
            {"role": "user", "content": user_message},
            {"role": "assistant", "content": answer},
        ]
    messages.append({"role": "user", "content": conversation.user_messages[turn]})
    return messages
