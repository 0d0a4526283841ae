"""Corpora for the search env: the records (`Passage`, `Question`, `Corpus`) and a synthetic fact-corpus generator.

The synthetic world (all names invented, so a model cannot know the facts and must search): people born in cities in
given years, cities in countries, companies founded by people in given years and headquartered in cities. Each fact
is one passage; distractor passages mention the same entities with other relations ("X moved to C", "C hosts a
festival"), so a passage that names the entity is not automatically the answer. Questions:

| hops | kind | example | answer |
|---|---|---|---|
| 1 | born_in | Where was Ada Marr born? | a city |
| 1 | birth_year | In which year was Ada Marr born? | a year |
| 1 | city_country | In which country is Tevlin? | a country (aliases: its official name) |
| 1 | founder | Who founded Brightloom? | a person |
| 1 | headquarters | In which city is Brightloom headquartered? | a city |
| 1 | founded_year | In which year was Brightloom founded? | a year |
| 2 | person_country | In which country was Ada Marr born? | born_in, then city_country |
| 2 | founder_birthplace | Where was the founder of Brightloom born? | founder, then born_in |
| 2 | founder_birth_year | In which year was the founder of Brightloom born? | founder, then birth_year |
| 2 | headquarters_country | In which country is Brightloom headquartered? | headquarters, then city_country |
| 3 | founder_country | In which country was the founder of Brightloom born? | founder, born_in, city_country |

Each question keeps the passages that support it (`gold_ids`) and one search query per hop (`queries`, naming the
bridge entity), so a scripted episode can solve it. The same seed gives the same corpus and questions in every
process (string-seeded `random.Random`, no set or hash ordering). The held-out split is `n_heldout` questions drawn
with the seed; the train split is every other question, so the two are disjoint by construction.

Extending: a new relation is a fact template list in `_FACTS`, a line in `_relations` and, for questions, a
`(kind, hops, question, answer, hops...)` line in `_questions`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    title: str = ""

    @property
    def display(self) -> str:
        return f"{self.title}: {self.text}" if self.title else self.text


@dataclass(frozen=True)
class Question:
    """A question with its gold answers (first = canonical, then aliases). `gold_ids` and `queries` are known for
    synthetic questions (supporting passages, one search query per hop) and empty for a user's QA file."""

    qid: str
    question: str
    answers: tuple[str, ...]
    hops: int = 1
    kind: str = ""
    gold_ids: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()


@dataclass(frozen=True)
class Corpus:
    """Passages to search and the question splits. `dropped` counts train questions removed because they repeat a
    held-out question (user files; never silent: `SearchEnv` reports it)."""

    passages: tuple[Passage, ...]
    train: tuple[Question, ...]
    heldout: tuple[Question, ...]
    dropped: int = 0

    def __repr__(self) -> str:
        return (f"Corpus({len(self.passages)} passages, {len(self.train)} train / {len(self.heldout)} held-out "
                f"questions, {self.dropped} dropped as held-out repeats)")


# ------------------------------------------------------------------------------------------------------- generator

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "j", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st",
           "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "x", "nd")

# Several phrasings per fact; every phrasing keeps the words a question about it uses (born, year, founded, ...):
# retrieval does not stem, so "headquarters" would not match a question's "headquartered".
_FACTS = {
    "born_in": ("{p} was born in {c}.", "{p} was born in the city of {c}."),
    "birth_year": ("{p} was born in the year {y}.", "The year {p} was born is {y}."),
    "city_country": ("{c} is a city in the country of {k}.", "The city of {c} lies in the country {k}."),
    "country": ("{k}, officially the {o}, is a country.",),
    "founder": ("{m} was founded by {p}.", "The company {m} was founded by {p}."),
    "headquarters": ("{m} is headquartered in the city of {c}.", "{m} is headquartered in {c}."),
    "founded_year": ("{m} was founded in the year {y}.", "The company {m} was founded in {y}."),
}
_DISTRACTORS = {
    "person": ("{p} moved to {c} as an adult.", "{p} gave a lecture in {c}.", "{p} admired the architecture of {c}."),
    "city": ("{c} hosts an annual music festival.", "Many visitors travel to {c} from {k2}.",
             "{c} has a famous old market."),
    "company": ("{m} opened an office in {c}.", "{m} sells its products in {k}.", "{p} once worked for {m}."),
}
_OFFICIAL = ("Republic of {k}", "Kingdom of {k}", "Federation of {k}")
_SUFFIXES = ("Labs", "Works", "Systems", "Foods", "Motors", "Media")


@dataclass(frozen=True)
class SyntheticCorpus:
    """A seeded synthetic fact world (module docstring). `max_hops` keeps questions of at most that many hops;
    `distractors` is the number of distractor passages per entity. `load()` builds it (deterministic, ~10 ms per
    thousand passages); envs cache the result per process.

    Example:
        >>> corpus = SyntheticCorpus(seed=0, n_people=20, n_cities=8, n_countries=3, n_companies=10, n_heldout=10).load()
        >>> q = corpus.heldout[0]
        >>> q.question, q.answers
        ('In which country was Wokram Dralgrix born?', ('Drearmithgaim', 'Kingdom of Drearmithgaim'))
    """

    seed: int = 0
    n_people: int = 200
    n_cities: int = 40
    n_countries: int = 10
    n_companies: int = 120
    distractors: int = 1
    max_hops: int = 3
    n_heldout: int = 200

    def __post_init__(self) -> None:
        sizes = (self.n_people, self.n_cities, self.n_countries, self.n_companies)
        if min(sizes) < 1 or self.distractors < 0 or self.n_heldout < 1:
            raise ValueError(f"SyntheticCorpus sizes must be >= 1 (distractors >= 0): {self}")
        if self.max_hops not in (1, 2, 3):
            raise ValueError(f"max_hops must be 1, 2 or 3, got {self.max_hops}")

    def load(self) -> Corpus:
        world = _World.generate(self)
        passages = world.passages(self)
        questions = world.questions(self.max_hops)
        if self.n_heldout >= len(questions):
            raise ValueError(f"n_heldout={self.n_heldout} leaves no train question out of {len(questions)}; lower "
                             "n_heldout or enlarge the world (n_people, n_companies, ...)")
        order = list(range(len(questions)))
        random.Random(f"{self.seed}/heldout").shuffle(order)
        held = set(order[: self.n_heldout])
        return Corpus(passages=passages,
                      train=tuple(q for i, q in enumerate(questions) if i not in held),
                      heldout=tuple(questions[i] for i in sorted(held)))


@dataclass
class _World:
    people: list[str]
    cities: list[str]
    countries: list[str]
    official: list[str]  # country i's official name (an answer alias)
    companies: list[str]
    born_in: list[int]  # person -> city
    birth_year: list[int]
    city_country: list[int]  # city -> country
    founder: list[int]  # company -> person
    headquarters: list[int]  # company -> city
    founded_year: list[int]
    fact_ids: dict[tuple[str, int], str]  # (relation, subject) -> passage id; filled by passages()

    @classmethod
    def generate(cls, spec: SyntheticCorpus) -> _World:
        rng = random.Random(f"{spec.seed}/world")
        used: set[str] = set()

        def name(syllables: int) -> str:
            while True:
                word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                               for _ in range(syllables))
                if len(word) >= 4 and word not in used:
                    used.add(word)
                    return word.capitalize()

        first_names = [name(2) for _ in range(max(8, spec.n_people // 4))]
        people: list[str] = []
        while len(people) < spec.n_people:  # first names repeat (realistic, and harder); full names are unique
            full = f"{rng.choice(first_names)} {name(2)}"
            people.append(full)
        countries = [name(3) for _ in range(spec.n_countries)]
        return cls(
            people=people, cities=[name(2) for _ in range(spec.n_cities)], countries=countries,
            official=[rng.choice(_OFFICIAL).format(k=k) for k in countries],
            companies=[f"{name(2)} {rng.choice(_SUFFIXES)}" for _ in range(spec.n_companies)],
            born_in=[rng.randrange(spec.n_cities) for _ in range(spec.n_people)],
            birth_year=[rng.randrange(1900, 2000) for _ in range(spec.n_people)],
            city_country=[i % spec.n_countries if i < spec.n_countries else rng.randrange(spec.n_countries)
                          for i in range(spec.n_cities)],  # every country has a city
            founder=[rng.randrange(spec.n_people) for _ in range(spec.n_companies)],
            headquarters=[rng.randrange(spec.n_cities) for _ in range(spec.n_companies)],
            founded_year=[rng.randrange(1950, 2021) for _ in range(spec.n_companies)],
            fact_ids={})

    def _relations(self) -> list[tuple[str, int, dict[str, str]]]:
        """(relation, subject index, template fields) for every fact."""
        out: list[tuple[str, int, dict[str, str]]] = []
        for i, p in enumerate(self.people):
            out.append(("born_in", i, {"p": p, "c": self.cities[self.born_in[i]]}))
            out.append(("birth_year", i, {"p": p, "y": str(self.birth_year[i])}))
        for i, c in enumerate(self.cities):
            out.append(("city_country", i, {"c": c, "k": self.countries[self.city_country[i]]}))
        for i, k in enumerate(self.countries):
            out.append(("country", i, {"k": k, "o": self.official[i]}))
        for i, m in enumerate(self.companies):
            out.append(("founder", i, {"m": m, "p": self.people[self.founder[i]]}))
            out.append(("headquarters", i, {"m": m, "c": self.cities[self.headquarters[i]]}))
            out.append(("founded_year", i, {"m": m, "y": str(self.founded_year[i])}))
        return out

    def passages(self, spec: SyntheticCorpus) -> tuple[Passage, ...]:
        rng = random.Random(f"{spec.seed}/passages")
        texts: list[tuple[str, str]] = []  # (kind key, text); ids are assigned after shuffling
        for rel, i, fields in self._relations():
            texts.append((f"{rel}/{i}", rng.choice(_FACTS[rel]).format(**fields)))
        for _ in range(spec.distractors):
            for p in self.people:
                texts.append(("distractor", rng.choice(_DISTRACTORS["person"]).format(
                    p=p, c=self.cities[rng.randrange(len(self.cities))])))
            for c in self.cities:
                texts.append(("distractor", rng.choice(_DISTRACTORS["city"]).format(
                    c=c, k2=self.countries[rng.randrange(len(self.countries))])))
            for m in self.companies:
                texts.append(("distractor", rng.choice(_DISTRACTORS["company"]).format(
                    m=m, c=self.cities[rng.randrange(len(self.cities))],
                    k=self.countries[rng.randrange(len(self.countries))],
                    p=self.people[rng.randrange(len(self.people))])))
        rng.shuffle(texts)  # position breaks BM25 ties: it must say nothing about which passage is a fact
        out = []
        for n, (key, text) in enumerate(texts):
            pid = f"p{n}"
            if key != "distractor":
                rel, i = key.split("/")
                self.fact_ids[(rel, int(i))] = pid
            out.append(Passage(pid, text))
        return tuple(out)

    def questions(self, max_hops: int) -> list[Question]:
        if not self.fact_ids:
            raise RuntimeError("_World.passages() assigns passage ids; call it before questions()")
        fid = self.fact_ids
        out: list[Question] = []

        def add(kind: str, subject: int, question: str, answers: tuple[str, ...],
                hops: list[tuple[str, int, str]]) -> None:
            if len(hops) <= max_hops:
                out.append(Question(f"{kind}/{subject}", question, answers, len(hops), kind,
                                    tuple(fid[(rel, i)] for rel, i, _ in hops), tuple(q for _, _, q in hops)))

        def country(k: int) -> tuple[str, ...]:
            return (self.countries[k], self.official[k])

        for i, p in enumerate(self.people):
            c = self.born_in[i]
            city = self.cities[c]
            born = ("born_in", i, f"Where was {p} born?")
            add("born_in", i, born[2], (city,), [born])
            add("birth_year", i, f"In which year was {p} born?", (str(self.birth_year[i]),),
                [("birth_year", i, f"In which year was {p} born?")])
            add("person_country", i, f"In which country was {p} born?", country(self.city_country[c]),
                [born, ("city_country", c, f"In which country is {city}?")])
        for i, city in enumerate(self.cities):
            add("city_country", i, f"In which country is {city}?", country(self.city_country[i]),
                [("city_country", i, f"In which country is {city}?")])
        for i, m in enumerate(self.companies):
            f, h = self.founder[i], self.headquarters[i]
            person, hq = self.people[f], self.cities[h]
            who = ("founder", i, f"Who founded {m}?")
            add("founder", i, who[2], (person,), [who])
            add("headquarters", i, f"In which city is {m} headquartered?", (hq,),
                [("headquarters", i, f"In which city is {m} headquartered?")])
            add("founded_year", i, f"In which year was {m} founded?", (str(self.founded_year[i]),),
                [("founded_year", i, f"In which year was {m} founded?")])
            birth_city = self.born_in[f]
            add("founder_birthplace", i, f"Where was the founder of {m} born?", (self.cities[birth_city],),
                [who, ("born_in", f, f"Where was {person} born?")])
            add("founder_birth_year", i, f"In which year was the founder of {m} born?", (str(self.birth_year[f]),),
                [who, ("birth_year", f, f"In which year was {person} born?")])
            add("headquarters_country", i, f"In which country is {m} headquartered?", country(self.city_country[h]),
                [("headquarters", i, f"In which city is {m} headquartered?"),
                 ("city_country", h, f"In which country is {hq}?")])
            add("founder_country", i, f"In which country was the founder of {m} born?",
                country(self.city_country[birth_city]),
                [who, ("born_in", f, f"Where was {person} born?"),
                 ("city_country", birth_city, f"In which country is {self.cities[birth_city]}?")])
        return out
