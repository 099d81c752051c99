"""The target writes the prompts (issue 14's data, stage 1 of training/selfgen.py).

From seed topics (prompts.py: TOPICS, MORE_TOPICS, ACTIONS, MATH_TOPICS, CODE_TOPICS,
CODE_TASKS, each optionally under an aspect such as "the history of {t}") the target completes
a few-shot list ("Questions people ask an AI assistant about {t}:\n1.") or answers a chat
request ("Write a list of 5 different questions a student might ask about {t}.") at
temperature ~0.9; every list item is cleaned (`clean_prompt`) and deduplicated. Kinds: chat,
explanation, lists, code, math, multi_turn (a chat question; selfgen.py has the target write
the follow-up once it has answered) and raw (an opening sentence, continued without the chat
template).

Held-out: topics, not prompts, are split (`held_out_topics`, by a hash of the topic, so the
split never depends on the seed), so no held-out prompt or near-duplicate of one is trained
on; every kind keeps at least one held-out topic (the code ones are measured apart).
"""

from __future__ import annotations

import hashlib
import math
import random
import re

from eaglekv.training import prompts as seeds
from eaglekv.training.feeder import Feeder, Job, default_capacity, progress_bar, sampled
from eaglekv.training.seqstore import KINDS

# share of the prompts of each kind (multi_turn prompts also give a second-turn sequence)
KIND_MIX = {"chat": 0.25, "explanation": 0.12, "lists": 0.1, "code": 0.18, "math": 0.1,
            "multi_turn": 0.15, "raw": 0.1}

_Q = ("Questions people ask an AI assistant about {ex}:\n{items}\n\n"
      "Questions people ask an AI assistant about {t}:\n1.")
FEW_SHOT = {   # (example topic, three examples); the target continues the list at "1."
    "chat": (_Q, [("cooking", ["How long should I boil an egg so the yolk stays soft?",
                               "Why does bread dough need to rest before baking?",
                               "Can you give me a simple recipe for tomato soup?"]),
                  ("the weather", ["Why is the sky blue on a clear day?",
                                   "What should I pack for a week of rain in Scotland?",
                                   "How do meteorologists predict storms?"])]),
    "explanation": ("Requests people send an AI assistant asking for an explanation about {ex}:"
                    "\n{items}\n\nRequests people send an AI assistant asking for an "
                    "explanation about {t}:\n1.",
                    [("cooking", ["Explain why bread dough needs to rest before baking.",
                                  "What is the difference between baking soda and baking "
                                  "powder, and when do I use each?",
                                  "Can you explain how a pressure cooker works?"])]),
    "lists": ("Requests people send an AI assistant asking for a list about {ex}:\n{items}\n\n"
              "Requests people send an AI assistant asking for a list about {t}:\n1.",
              [("cooking", ["List five vegetables that grow well in winter.",
                            "Give me a list of spices I need for a simple curry.",
                            "What are ten easy dinners I can cook in 20 minutes?"])]),
    "code": ("Programming tasks people give an AI assistant about {ex}:\n{items}\n\n"
             "Programming tasks people give an AI assistant about {t}:\n1.",
             [("strings", ["Write a Python function that counts the vowels in a string.",
                           "Write a JavaScript function that capitalizes every word in a "
                           "sentence.", "How do I check in Python whether two strings are "
                           "anagrams?"]),
              ("files", ["Write a Python script that prints the ten largest files in a folder.",
                         "How do I read a text file line by line in Java?",
                         "Write a shell command that counts the lines of every .py file."])]),
    "math": ("Math problems people ask an AI assistant to solve about {ex}:\n{items}\n\n"
             "Math problems people ask an AI assistant to solve about {t}:\n1.",
             [("shopping", ["A shirt costs $25 and is on sale for 20% off. What is the sale "
                            "price?", "Tom buys 3 apples at $0.40 each and 2 pears at $0.65 "
                            "each. How much does he spend in total?",
                            "Solve for x: 3x + 7 = 22."])]),
    "raw": ("Opening sentences of articles about {ex}:\n{items}\n\n"
            "Opening sentences of articles about {t}:\n1.",
            [("cooking", ["Few smells are as comforting as fresh bread coming out of the oven.",
                          "Cooking at home is cheaper and healthier than most people think.",
                          "The history of the spice trade is a history of the world."])]),
}
CHAT_WRITERS = {   # a chat request through the template; the target answers with a list
    "chat": "Write a list of 5 different questions {who} might ask about {t}.",
    "explanation": "Write a list of 5 different things {who} might ask you to explain about {t}.",
}
# a cleaned prompt ends with "?" or starts with one of these (a question or an instruction)
IMPERATIVES = set("""write explain describe list give tell show create implement make compute
calculate find solve compare name suggest help summarize define convert generate build design
provide recommend outline translate plan prove simplify estimate sort count check print read
parse use draw fix debug rewrite how what why when where which who whose can could would should
is are do does did will if please imagine""".split())
# a prompt of these kinds names what it is about (a writer asked for code can drift to chat);
# the held-out code prompts are measured apart, so their label must hold
KIND_CUES = {
    "code": set("""code program script function class method python javascript java c c++ c#
rust go sql html css bash shell typescript regex array string strings list lists dictionary
loop recursion algorithm api json csv file files variable compile debug implement""".split()),
    "math": set("""solve calculate compute how many much percent percentage fraction average
sum product equation probability area volume total cost price times twice half ratio""".split()),
    "lists": set("""list lists ways tips ideas examples steps facts reasons things types kinds
some top best names few ten five three four seven""".split()),
}
# a prompt leaning on an earlier item ("How do they ...?") has lost its subject
DANGLING = set("they them their he she his her its these those".split())
LEAKS = ("ai assistant", "requests people", "questions people", "opening sentences",
         "programming tasks", "math problems", "follow-up", "conversation:", "list of 5")
_ITEM = re.compile(r"^\s*(?:\d{1,2}[.)]|[-*\u2022])\s+(.*)$")
_WORD = re.compile(r"[a-z0-9]+")
_STOP = set("the a an of to in on for and or is are what how why do does i my me you your "
            "can could would should with about this that it be".split())


# ---- seed topics and the held-out split ---------------------------------------------------------
def kind_topics(kind: str) -> list[str]:
    """The seed topics a kind's prompts are written about."""
    if kind == "code":
        return seeds.CODE_TOPICS + [f"code that {c}" for c in seeds.CODE_TASKS]
    if kind == "math":
        return list(seeds.MATH_TOPICS)
    howto = [f"how to {a}" for a in seeds.ACTIONS]
    return seeds.TOPICS + seeds.MORE_TOPICS + (howto if kind != "raw" else [])


def _topic_hash(topic: str) -> float:
    """A topic's place in [0, 1): the first 8 hex digits of sha256 of its lower-cased text."""
    return int(hashlib.sha256(topic.lower().encode()).hexdigest()[:8], 16) / 16 ** 8


def held_out_topics(frac: float) -> frozenset[str]:
    """Topics whose prompts are held out: hash < frac, plus, for a kind left with none, its
    lowest-hash topic. Depends on `frac` only (never on the seed), so two runs agree."""
    out = set()
    for kind in KINDS:
        pool = kind_topics(kind)
        chosen = {t for t in pool if _topic_hash(t) < frac}
        if not chosen and frac > 0:
            chosen = {min(pool, key=_topic_hash)}
        out |= chosen
    return frozenset(out)


# ---- cleaning the target's lists ----------------------------------------------------------------
def parse_candidates(text: str, numbered_first: bool) -> list[str]:
    """List items of the target's text: lines "1. ...", "- ..."; `numbered_first`: the text
    continues a "1." the writer's prompt ended with, so its first line is item 1."""
    lines = text.split("\n")
    out = [lines[0].strip()] if numbered_first else []
    for line in lines[1 if numbered_first else 0:]:
        m = _ITEM.match(line)
        if m:
            out.append(m.group(1).strip())
    return out


def clean_prompt(text: str, kind: str) -> str | None:
    """One candidate as a prompt, or None: first line, markup and quotes stripped, 3..60 words
    (raw: 5..60, a sentence), at least half of them distinct, a question or an instruction
    with its subject (no "they" in its first words) and, for code, math and lists, a word of
    its kind (KIND_CUES); nothing of the writer's prompt."""
    t = text.strip().split("\n")[0].strip().replace("**", "").strip()
    t = _ITEM.sub(r"\1", t).strip()
    if len(t) >= 2 and t[0] in "\"'\u201c" and t[-1] in "\"'\u201d":
        t = t[1:-1].strip()
    words = t.split()
    if not 3 <= len(words) <= 60 or any(x in t.lower() for x in LEAKS):
        return None
    if len(words) >= 8 and len({w.lower() for w in words}) < 0.5 * len(words):
        return None                                  # a loop ("why? why? why? ...")
    if kind == "raw":
        return t if len(words) >= 5 and t[-1] in ".!?" else None
    lower = [w.lower().strip("\"',:.?!()") for w in words]
    if DANGLING & set(lower[:3]) or (kind in KIND_CUES and not (
            KIND_CUES[kind] & set(lower) or (kind == "math" and any(c.isdigit() for c in t)))):
        return None
    return t if t.endswith("?") or (lower[0] in IMPERATIVES and t[-1] in ".?!:)") else None


def norm_key(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def near_key(text: str) -> str:
    """Its content words as a set: "What is a volcano?" and "what's a volcano" share one."""
    return " ".join(sorted({w for w in _WORD.findall(text.lower()) if w not in _STOP}))


def user_message(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- the target writes the prompts --------------------------------------------------------------
def _writer(engine, kind: str, topic: str, rng: random.Random) -> tuple[list[int], bool]:
    """The writer prompt for one (kind, topic): ids, and whether the reply continues a "1."."""
    subject = topic if kind in ("code", "math") else rng.choice(seeds.ASPECTS).format(t=topic)
    wkind = "chat" if kind == "multi_turn" else kind
    if wkind in CHAT_WRITERS and rng.random() < 0.4:
        msg = CHAT_WRITERS[wkind].format(who=rng.choice(seeds.PERSONAS), t=subject)
        return engine.apply_chat_template(user_message(msg)), False
    tmpl, examples = FEW_SHOT[wkind]
    ex, items = rng.choice(examples)
    text = tmpl.format(ex=ex, items="\n".join(f"{i + 1}. {q}" for i, q in enumerate(items)),
                       t=subject)
    return engine.encode(text), True


def prompt_ids(engine, prompt: dict) -> list[int]:
    """A prompt's tokens as the engine runs it: chat ones through the chat template."""
    if "conversation" in prompt:
        return engine.apply_chat_template(prompt["conversation"])
    return engine.apply_chat_template(user_message(prompt["text"])) if prompt["chat"] \
        else engine.encode(prompt["text"])


def write_prompts(engine, n: int, *, heldout_frac: float = 0.1, seed: int = 0,
                  deadline: float = math.inf, temperature: float = 0.9, max_new: int = 100,
                  mix: dict[str, float] | None = None, capacity: int | None = None,
                  progress: bool = True) -> tuple[list[dict], dict]:
    """Up to `n` distinct prompts written by the target, shared among kinds as `mix` (default
    KIND_MIX): [{"text", "ids", "kind", "topic", "held_out", "chat"}]; fewer if `deadline`
    (time.monotonic()) comes first. Held-out prompts are those of `held_out_topics`; a train
    prompt equal to a held-out one up to case, punctuation or word order is dropped.
    Returns (prompts, the writer's Feeder stats)."""
    mix = mix or KIND_MIX
    total = sum(mix.values())
    target = {k: int(n * w / total) for k, w in mix.items()}
    for k in sorted(mix, key=mix.get, reverse=True)[:n - sum(target.values())]:
        target[k] += 1                                          # the rounding's remainder
    held = held_out_topics(heldout_frac)
    rng = random.Random(seed)
    seen = {norm_key(q) for _, examples in FEW_SHOT.values() for _, qs in examples for q in qs}
    got = {k: [] for k in target}
    pending = {k: 0 for k in target}
    yields = {k: [2.0, 1] for k in target}      # accepted items / finished writers, per kind
    feeder = Feeder(engine, default_capacity(engine, capacity), deadline, max_new,
                    progress_bar(n, "writing prompts", progress))

    def done(kind, topic, numbered_first, req):
        pending[kind] -= 1
        found = 0
        for cand in parse_candidates(req.refresh_text(), numbered_first):
            text = clean_prompt(cand, "chat" if kind == "multi_turn" else kind)
            if text is None or norm_key(text) in seen:
                continue
            seen.add(norm_key(text))
            found += 1
            if len(got[kind]) < target[kind]:
                got[kind].append({"text": text, "kind": kind, "topic": topic,
                                  "held_out": topic in held, "chat": kind != "raw"})
                feeder.bar.update(1)
        yields[kind][0] += found
        yields[kind][1] += 1

    def refill():
        while len(feeder.queue) < feeder.capacity:
            # the kind furthest from its target, counting what its writers in flight will give
            left = {k: target[k] - len(got[k]) - pending[k] * yields[k][0] / yields[k][1]
                    for k in target}
            kind = max(left, key=left.get)
            if left[kind] <= 0:
                return
            topic = rng.choice(kind_topics(kind))
            ids, numbered = _writer(engine, kind, topic, rng)
            stop = ("\n\n",) if numbered else ()
            params = sampled(temperature, rng, max_new_tokens=max_new, stop=stop)
            pending[kind] += 1
            feeder.push(Job(ids, params, lambda r, k=kind, t=topic, nf=numbered:
                            done(k, t, nf, r)))

    feeder.run(refill, stop=lambda: all(len(got[k]) >= target[k] for k in target))
    feeder.bar.close()
    out = [p for k in target for p in got[k]]
    keys = lambda text: {norm_key(text), near_key(text)} - {""}  # noqa: E731
    held_keys = set().union(*(keys(p["text"]) for p in out if p["held_out"]))
    out = [p for p in out if p["held_out"] or not keys(p["text"]) & held_keys]
    rng.shuffle(out)              # kinds mixed, so a budget cut later spares none
    for p in out:
        p["ids"] = prompt_ids(engine, p)
    return out, feeder.stats()
