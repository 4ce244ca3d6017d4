"""Math word problems with a verifier: numeric answers extracted from a completion and compared with the
reference, and a seeded generator of GSM8K-style problems shipped in the package (no download).

Answer extraction (`extract_answer`), first form found wins:
  1. the last `\\boxed{...}` (LaTeX; nested braces allowed)
  2. the last `#### <number>` (GSM8K's answer line)
  3. the last number anywhere in the text
Numbers may carry thousands separators ("1,234"), a sign, decimals, a leading "$" or a trailing "%"; a
fraction "a/b" inside \\boxed{} is evaluated. `answers_match` compares with a relative tolerance of 1e-6
(so "12.0" == "12"); a reference that is not a number is compared as stripped text.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

_NUMBER = r"[-+]?\$?\s*\d[\d,]*(?:\.\d+)?%?|[-+]?\$?\s*\.\d+%?"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_FRACTION_RE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s*$")
_TEX_FRAC_RE = re.compile(r"^\s*([-+]?)\\d?frac\{([^{}]+)\}\{([^{}]+)\}\s*$")


def parse_number(text: str) -> float | None:
    """One number written as people write it ("1,234", "$5", "-3.5", "40%", "3/4"), else None."""
    t = text.strip().rstrip(".").replace("\\!", "").replace("\\,", "")
    t = re.sub(r"^\\text\{(.*)\}$", r"\1", t).strip()
    plain = _FRACTION_RE.match(t)
    if plain:
        num, den = float(plain.group(1)), float(plain.group(2))
        return None if den == 0 else num / den
    tex = _TEX_FRAC_RE.match(t)
    if tex:
        num, den = _plain_float(tex.group(2)), _plain_float(tex.group(3))
        if num is None or not den:
            return None
        return (-1.0 if tex.group(1) == "-" else 1.0) * num / den
    return _plain_float(t)


def _plain_float(t: str) -> float | None:
    t = t.strip().replace("$", "").replace(" ", "").rstrip("%").replace(",", "")
    try:
        value = float(t)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no boxed answer


def extract_answer(text: str) -> float | None:
    """The completion's final numeric answer (see the module doc for the forms), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        value = parse_number(boxed)
        if value is not None:
            return value
        found = _NUMBER_RE.findall(boxed)
        return parse_number(found[-1]) if found else None
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return parse_number(hashes[-1])
    found = _NUMBER_RE.findall(text)
    return parse_number(found[-1]) if found else None


def reference_value(answer: Any) -> float | None:
    """A reference answer as a number: numbers as they are; strings through `extract_answer` (so a GSM8K
    solution text "... #### 72" gives 72)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return float(answer) if math.isfinite(answer) else None
    if isinstance(answer, str):
        return extract_answer(answer)
    return None


def answers_match(completion: str, answer: Any) -> bool:
    """True when the completion's extracted answer equals the reference (numbers within 1e-6 relative;
    non-numeric references: the stripped completion equals the stripped reference)."""
    want = reference_value(answer)
    if want is None:
        return answer is not None and completion.strip() == str(answer).strip()
    got = extract_answer(completion)
    return got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)


def has_answer_format(completion: str) -> bool:
    """The completion marks its answer explicitly: a `\\boxed{}` or a `####` line holding a number."""
    boxed = _last_boxed(completion)
    return (boxed is not None and bool(_NUMBER_RE.search(boxed))) or bool(_HASHES_RE.search(completion))


# -- the generator -----------------------------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena")
_ITEMS = (("apples", "basket"), ("marbles", "jar"), ("stickers", "sheet"), ("pencils", "box"),
          ("cookies", "tray"), ("stamps", "album page"))
_INSTRUCTION = " Give the final answer as a number after ####."


def _groups_minus(rng: random.Random) -> tuple[str, int]:
    name, (item, holder) = rng.choice(_NAMES), rng.choice(_ITEMS)
    groups, each = rng.randint(2, 9), rng.randint(3, 15)
    given = rng.randint(1, groups * each - 1)
    return (f"{name} has {groups} {holder}s with {each} {item} in each {holder}. {name} gives away {given} "
            f"{item}. How many {item} does {name} have left?", groups * each - given)


def _shopping(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    a_n, a_p, b_n, b_p = rng.randint(2, 6), rng.randint(2, 12), rng.randint(1, 5), rng.randint(3, 20)
    cost = a_n * a_p + b_n * b_p
    paid = (cost // 10 + rng.randint(1, 5)) * 10
    return (f"{name} buys {a_n} notebooks at ${a_p} each and {b_n} pens at ${b_p} each, and pays with "
            f"${paid}. How much change, in dollars, does {name} get?", paid - cost)


def _share(rng: random.Random) -> tuple[str, int]:
    a, b = rng.sample(_NAMES, 2)
    per, friends, extra = rng.randint(2, 12), rng.randint(2, 8), rng.randint(1, 20)
    total = per * friends + extra
    return (f"{a} baked {total} muffins, kept {extra} and shared the rest equally among {friends} friends, "
            f"one of them {b}. How many muffins did {b} get?", per)


def _speed(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    speed, hours = rng.randint(20, 80), rng.randint(2, 6)
    back = rng.randint(1, hours - 1)
    return (f"{name} drives at {speed} km per hour for {hours} hours, then drives back toward home for "
            f"{back} hours at the same speed. How far from home, in km, is {name} now?", speed * (hours - back))


def _weekly(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(_NAMES)
    per_day, days, weeks, spent = rng.randint(2, 9), rng.randint(3, 7), rng.randint(2, 5), rng.randint(1, 10)
    return (f"{name} saves ${per_day} a day, {days} days a week, for {weeks} weeks, then spends ${spent}. "
            f"How many dollars does {name} have?", per_day * days * weeks - spent)


_TEMPLATES = (_groups_minus, _shopping, _share, _speed, _weekly)


def word_problem(rng: random.Random) -> tuple[str, int]:
    """One GSM8K-style problem (two to three arithmetic steps, integer answer) from `rng`: (prompt, answer);
    the "math" task (rl/tasks.py) makes it an `Example`."""
    question, answer = rng.choice(_TEMPLATES)(rng)
    return question + _INSTRUCTION, answer
