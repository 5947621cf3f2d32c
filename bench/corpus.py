"""Synthetic material for the multi-turn workloads, generated offline from a `random.Random`.

Nothing is read from disk or the network, so a seed fixes every byte on any Python version:
filler prose from word lists, UUID-like keys and values, and Python source files made of
small functions and constants whose values a question can ask for.
"""

from __future__ import annotations

import random
from typing import NamedTuple

SUBJECTS = ("The committee", "A traveller", "The old bridge", "Every gardener", "The river",
            "Our neighbour", "The orchestra", "A small company", "The library", "The mountain")
VERBS = ("described", "remembered", "carried", "measured", "painted", "ignored", "followed",
         "repaired", "admired", "questioned")
OBJECTS = ("the long winter", "a quiet harbour", "the morning market", "an empty station",
           "the northern forest", "a stack of letters", "the village clock", "a copper kettle",
           "the evening train", "a field of barley")
TAILS = ("before the rain began", "with great patience", "for the third time this year",
         "while the lamps were lit", "without saying a word", "as the tide came in",
         "after a long discussion", "under a pale sky", "near the old mill", "in the afternoon")
COLORS = ("red", "blue", "green", "golden", "silver", "violet", "amber", "white", "black", "grey")
ANIMALS = ("fox", "owl", "otter", "heron", "badger", "falcon", "hare", "lynx", "crane", "wolf")
WORDS = ("river", "stone", "cloud", "ember", "maple", "harbor", "signal", "lantern", "meadow",
         "copper", "quartz", "willow", "tunnel", "beacon", "canyon", "orbit", "prism", "saddle")


def sentence(rng: random.Random) -> str:
    """One filler sentence, e.g. "The river admired a quiet harbour under a pale sky."."""
    return (f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(TAILS)}.")


def uuid_like(rng: random.Random) -> str:
    """A random 8-4-4-4-12 hex string (UUID-shaped, not RFC-4122 versioned)."""
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Needle(NamedTuple):
    """A fact hidden in filler text: "The secret number of the <color> <animal> is <value>."."""

    name: str  # "red fox"
    value: str  # "4821"

    @property
    def text(self) -> str:
        return f"The secret number of the {self.name} is {self.value}."


def needles(rng: random.Random, n: int) -> list[Needle]:
    """`n` needles with distinct names and distinct 5-digit values."""
    names = rng.sample([f"{c} {a}" for c in COLORS for a in ANIMALS], n)
    values = rng.sample(range(10000, 100000), n)
    return [Needle(name, str(v)) for name, v in zip(names, values, strict=True)]


class CodeItem(NamedTuple):
    """One top-level definition of a synthetic source file and the fact a question checks."""

    source: str  # the definition's lines
    question: str
    answer: str


def code_item(rng: random.Random, index: int) -> CodeItem:
    """A constant or a function returning a constant (names are unique through `index`)."""
    a, b = rng.sample(WORDS, 2)
    value = str(rng.randrange(100, 100000))
    if rng.random() < 0.5:
        name = f"{a.upper()}_{b.upper()}_LIMIT_{index}"
        return CodeItem(f"{name} = {value}\n",
                        f"What is the value of the constant {name}?", value)
    name = f"compute_{a}_{b}_{index}"
    noise = rng.randrange(2, 9)
    source = (f"def {name}(items):\n"
              f'    """Return the {a} threshold used when {b} items are merged."""\n'
              f"    scale = len(items) * {noise}\n"
              f"    if scale < 0:\n"
              f"        raise ValueError('negative size')\n"
              f"    return {value}\n")
    return CodeItem(source, f"What integer does the function {name} return?", value)
