"""Pull final answers out of model text and compare them, as pure string functions.

Rule-based rewards for math tasks live or die by these few functions: a missed `\\boxed{}` or
a `0.5` judged unequal to `\\frac{1}{2}` turns a correct rollout into a zero reward. Numbers are
compared exactly with `fractions.Fraction` (no float round-off, so 1/3 != 0.333) and nothing is
ever evaluated as code: the numeric parser accepts only integers, decimals, scientific notation,
`a/b` and `\\frac{a}{b}`. Anything else is compared as a normalised string.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# Exponents beyond this are refused: Fraction(Decimal("1e999999999")) would build a huge integer.
_MAX_EXPONENT = 100

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_GSM8K_FINAL = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*\$?\s*(" + _NUMBER + r")", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_LINE = re.compile(r"^[ \t]*answer[ \t]*:[ \t]*(\S.*?)[ \t]*$", re.IGNORECASE | re.MULTILINE)
_DECIMAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC_BRACED = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"(-?)\\frac(\d)(\d)")  # \frac12
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_LEADING_VARIABLE = re.compile(r"^[a-z]=(?!=)")  # "x=5" -> "5"
# LaTeX spacing and sizing commands and the unit marks the answer does not depend on.
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}",
            "\\%", "%", "\\$", "$")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or of `\\boxed 42`.

    Returns None when there is no `\\boxed` or its braces never close.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    if text.startswith(" ", i):  # "\boxed 42": the answer runs to the next space or '$'
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def extract_answer_tag(text: str) -> str | None:
    """Stripped content of the last `<answer>...</answer>`, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def extract_answer_line(text: str) -> str | None:
    """The rest of the last line that starts with "Answer:" (DAPO's and Minerva's final-answer form)."""
    found = _ANSWER_LINE.findall(text)
    return found[-1] if found else None


def extract_math_answer(text: str) -> str | None:
    """A math response's final answer: the last `\\boxed{}`, else the last `<answer>` tag, else the
    last "Answer: ..." line; None when it gives none of them."""
    for extract in (extract_boxed, extract_answer_tag, extract_answer_line):
        answer = extract(text)
        if answer is not None:
            return answer
    return None


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (GSM8K's final-answer marker), commas removed."""
    found = _GSM8K_FINAL.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text ('1,234.5' -> '1234.5'); a sentence's full stop is not kept."""
    found = _ANY_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_final_number(text: str) -> str | None:
    """The number after the last "answer is" ("The answer is 42."), else the text's last number."""
    found = _ANSWER_IS.findall(text)
    return found[-1].replace(",", "") if found else extract_last_number(text)


def normalize_answer(s: str) -> str:
    """Canonical text form: no spaces, lower case, no `$`/`%`/degree marks/`\\text{}` wrappers.

    Also maps \\dfrac and \\tfrac to \\frac, the unicode minus to '-', drops a trailing full stop
    and a leading single-letter assignment ("x = 5" -> "5").
    """
    s = s.strip().replace("\u2212", "-")
    s = _TEXT_WRAPPER.sub(r"\1", s)
    for token in _DROPPED:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split()).lower()
    s = _LEADING_VARIABLE.sub("", s)
    return s.rstrip(".")


def _parse_number(s: str) -> Fraction | None:
    """Exact value of a normalised plain number, `a/b` or `\\frac{a}{b}`; None otherwise."""
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    for pattern in (_FRAC_BRACED, _FRAC_SHORT):
        match = pattern.fullmatch(s)
        if match:
            sign, num, den = match.groups()
            value = _ratio(num, den)
            return -value if (value is not None and sign) else value
    if s.count("/") == 1:
        return _ratio(*s.split("/"))
    return _decimal(s)


def _ratio(num: str, den: str) -> Fraction | None:
    a, b = _decimal(num), _decimal(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def _decimal(s: str) -> Fraction | None:
    if not _DECIMAL.fullmatch(s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if abs(value.as_tuple().exponent) > _MAX_EXPONENT:
        return None
    return Fraction(value)


def answers_equal(a: str, b: str) -> bool:
    """True when two answers agree: as exact numbers if both parse, else as normalised text.

    Examples: 3 == 3.0, 0.5 == 1/2 == \\frac{1}{2} == \\dfrac12, 1e5 == 100000, "1,000" == 1000,
    "$5" == 5, "50%" == 50, "\\text{yes}" == "Yes"; but 1/2 != 0.25 and 3 != 30.
    """
    na, nb = normalize_answer(a), normalize_answer(b)
    if na == nb:
        return bool(na)  # two empty answers agree on nothing
    va, vb = _parse_number(na), _parse_number(nb)
    return va is not None and va == vb
