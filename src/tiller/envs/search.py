"""Search QA (Search-R1 style): multi-hop questions over a generated corpus of fictional facts.

A world of invented countries, cities, people and towns is generated from a fixed world seed;
each fact is one passage ("The capital of Velmora is Dastrin.", "Dastrin was founded by Orla
Penn."), indexed with BM25 (`bm25s`). A question chains 1..3 relations from an anchor ("What is
the birthplace of the founder of the capital of Velmora?") and `difficulty` sets the hops.
Every passage states one fact about two entities, so no passage names both the anchor and the
answer of a multi-hop question: it takes one `search` per hop. The corpus is shared by both
splits; only the questions are split, by a hash of (anchor, relations). Exact match after
SQuAD normalization on "The answer is X."
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from typing import Any

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Task, ToolEnv, register_env
from tiller.envs.splits import draw_split, split_size, stable_id
from tiller.envs.verifiers import Reward, all_of, extract_answer_is, normalized_match
from tiller.errors import require_package
from tiller.tools.registry import ToolError, tool

WORLD_SEED = 0  # one world for every split and seed, so held-out questions ask about it too
TOP_K = 3
SYSTEM = (
    "Answer the question using the search tool; each search returns a few passages. "
    "End with: The answer is X."
)
# relation -> (passage template, question phrase, expert's query, type of subject, type of object)
_RELATIONS = {
    "capital": ("The capital of {s} is {o}.", "the capital of {s}", "capital of {s}",
                "country", "city"),
    "founder": ("{s} was founded by {o}.", "the founder of {s}", "{s} founded by",
                "city", "person"),
    "born": ("{s} was born in {o}.", "the birthplace of {s}", "{s} born in", "person", "town"),
    "teacher": ("{s} studied under {o}.", "the teacher of {s}", "{s} studied under",
                "person", "person"),
}  # fmt: skip


@dataclass(frozen=True)
class World:
    facts: dict[tuple[str, str], str]  # (subject, relation) -> object
    passages: list[str]
    mentions: dict[str, set[int]]  # entity -> the passages that name it
    retriever: Any  # bm25s.BM25


def _names(rng: random.Random, n: int, used: set[str]) -> list[str]:
    """`n` invented words, none sharing a lowercase token with any other name in the world."""
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
              "kr", "st", "th"]
    vowels, codas = "aeiou", "nrlsx"
    out: list[str] = []
    while len(out) < n:
        word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 2)))
        word = (word + rng.choice(codas)).capitalize()
        if word.lower() not in used and len(word) > 3:
            used.add(word.lower())
            out.append(word)
    return out


@cache
def world(seed: int = WORLD_SEED, n_countries: int = 200) -> World:
    """The corpus and its BM25 index, built once per process (deterministic from `seed`)."""
    bm25s = require_package("bm25s", "search", "env search")

    rng = random.Random(f"search-world/{seed}")
    used = set(bm25s.stopwords.STOPWORDS_EN)  # a name must never be dropped from a query
    used |= {w.lower() for t in _RELATIONS.values() for w in t[0].split()}
    countries, capitals = _names(rng, n_countries, used), _names(rng, n_countries, used)
    towns = _names(rng, n_countries // 2, used)
    first, last = _names(rng, 2 * n_countries, used), _names(rng, 2 * n_countries, used)
    people = [f"{a} {b}" for a, b in zip(first, last, strict=True)]
    facts = {(c, "capital"): city for c, city in zip(countries, capitals, strict=True)}
    founders = rng.sample(people, n_countries)
    facts.update({(city, "founder"): p for city, p in zip(capitals, founders, strict=True)})
    facts.update({(p, "born"): rng.choice(towns) for p in people})
    # Teachers form disjoint chains (each person teaches at most one), so no cycles and a
    # "studied under" search about someone returns at most two such passages.
    order = rng.sample(people, len(people))
    for student, teacher in zip(order[1:], order[:-1], strict=True):
        if rng.random() < 0.75:
            facts[(student, "teacher")] = teacher
    triples = list(facts.items())
    rng.shuffle(triples)
    passages = [_RELATIONS[r][0].format(s=s, o=o) for (s, r), o in triples]
    mentions: dict[str, set[int]] = {}
    for i, ((s, _), o) in enumerate(triples):
        mentions.setdefault(s, set()).add(i)
        mentions.setdefault(o, set()).add(i)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(passages, stopwords="en", show_progress=False),
                    show_progress=False)
    return World(facts, passages, mentions, retriever)


def search_passages(w: World, query: str, k: int = TOP_K) -> list[str]:
    import bm25s

    tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    docs, scores = w.retriever.retrieve(tokens, k=k, show_progress=False)
    return [w.passages[d] for d, s in zip(docs[0], scores[0], strict=True) if s > 0]


def _hops(difficulty: int) -> range:
    return range(min(difficulty, 2), min(difficulty, 3) + 1)


def _no_shortcut(w: World, nodes: list[str]) -> bool:
    """No entity repeats and no passage names two entities of the chain that are not
    neighbours in it (e.g. a teacher born in the same town as the student would let
    "birthplace of the student" answer in one hop)."""
    return len(set(nodes)) == len(nodes) and not any(
        w.mentions[a] & w.mentions[b] for i, a in enumerate(nodes) for b in nodes[i + 2 :])


def _draw(rng: random.Random, difficulty: int, w: World,
          max_tries: int = 10_000) -> tuple[str, tuple[str, ...]]:
    """An anchor and a chain of relations with no shortcut: a random walk, retried."""
    hops = rng.choice(_hops(difficulty))
    subjects = sorted({s for s, _ in w.facts})
    for _ in range(max_tries):
        anchor = node = rng.choice(subjects)
        relations: list[str] = []
        while len(relations) < hops:
            options = [r for r in _RELATIONS if (node, r) in w.facts]
            if not options:
                break
            relations.append(rng.choice(options))
            node = w.facts[(node, relations[-1])]
        if len(relations) == hops and _no_shortcut(w, chain(w, anchor, tuple(relations))):
            return anchor, tuple(relations)
    raise RuntimeError(f"search: no {hops}-hop question without a shortcut in {max_tries} walks")


def chain(w: World, anchor: str, relations: tuple[str, ...]) -> list[str]:
    """The entities along the way: anchor, each hop's answer, ..., the final answer."""
    nodes = [anchor]
    for r in relations:
        nodes.append(w.facts[(nodes[-1], r)])
    return nodes


def make_tasks(split: str, n: int, seed: int, difficulty: int = 2,
               heldout_fraction: float = 0.2) -> list[Task]:
    """`n` distinct questions of `split` about the shared world, chosen with `seed`."""
    w = world()
    rng = random.Random(f"search/{split}/{seed}/{difficulty}")
    drawn = draw_split(split, n, rng, lambda r: _draw(r, difficulty, w), json.dumps,
                       heldout_fraction)
    tasks = []
    for anchor, relations in drawn:
        phrase = anchor
        for r in relations:
            phrase = _RELATIONS[r][1].format(s=phrase)
        wh = "Who" if _RELATIONS[relations[-1]][4] == "person" else "What"
        nodes = chain(w, anchor, relations)
        tasks.append(Task(
            id=stable_id("search", json.dumps([anchor, relations])), split=split, system=SYSTEM,
            prompt=f"{wh} is {phrase}?", answer=nodes[-1],
            metadata={"anchor": anchor, "relations": relations, "chain": nodes,
                      "difficulty": len(relations)},  # the hops
        ))  # fmt: skip
    return tasks


def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
    """Distinct questions of `split`: every chain of the world's facts with a hop count the
    difficulty allows and no shortcut, counted (about 880 train ones at difficulty 2)."""
    w = world()

    def walks(node: str, hops: int) -> list[tuple[str, ...]]:
        if hops == 0:
            return [()]
        return [(r, *rest) for r in _RELATIONS if (node, r) in w.facts
                for rest in walks(w.facts[(node, r)], hops - 1)]

    keys = (json.dumps((anchor, relations))
            for anchor in sorted({s for s, _ in w.facts}) for hops in _hops(difficulty)
            for relations in walks(anchor, hops) if _no_shortcut(w, chain(w, anchor, relations)))
    return split_size(keys, split, heldout_fraction)


def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                guess_prob: float = 0.0) -> str:
    """One search per hop about the entity found so far, then the answer. With `guess_prob`,
    after the first search it answers with that hop's entity (the one-hop shortcut)."""
    nodes, relations = task.metadata["chain"], task.metadata["relations"]
    done = sum(m["role"] == "tool" for m in messages)
    if done == 1 and len(relations) > 1 and rng.random() < guess_prob:
        return f"The answer is {nodes[1]}."
    if done < len(relations):
        query = _RELATIONS[relations[done]][2].format(s=nodes[done])
        call = json.dumps({"name": "search", "arguments": {"query": query}})
        return f"<tool_call>\n{call}\n</tool_call>"
    return f"The answer is {nodes[-1]}."


@tool
async def search(query: str) -> str:
    """Search the encyclopedia; returns the best-matching passages.

    Args:
        query: keywords, e.g. 'capital of Velmora'.
    """
    if not query.strip():
        raise ToolError("query is empty")
    hits = search_passages(world(), query)
    return "\n".join(f"{i}. {p}" for i, p in enumerate(hits, 1)) or "(no results)"


@register_env
class SearchEnv(ToolEnv):
    name = "search"

    requires = {"bm25s": "search"}
    make_tasks = staticmethod(make_tasks)
    task_space = staticmethod(task_space)
    expert_turn = staticmethod(expert_turn)

    def __init__(self, **kwargs: Any):
        super().__init__([search], **kwargs)

    async def verify(self, final: ParsedTurn | None) -> Reward:
        assert self.task is not None
        answer = extract_answer_is(final.content) if final is not None else None
        return all_of(format_ok=answer is not None,
                      correct=normalized_match(answer, self.task.answer))
