"""torch.load's refusal of a file, told in one whole line.

torch's messages run to paragraphs: a zip archive it cannot read ends in advice about corrupted
checkpoints, and a `weights_only` refusal opens with three sentences about a default that changed in
PyTorch 2.6 before it names what it refused. A user is told what is wrong with the file, whole, in
our words where torch's are advice: never a message cut at a number of characters.
"""

from __future__ import annotations

import re

UNREADABLE_ZIP = "not a zip archive torch can read: truncated, or not a torch file"
# The lines of a weights_only refusal that are torch's advice, not what it refused.
WEIGHTS_ONLY_ADVICE = ("Weights only load failed", "Please file an issue", "Check the documentation")
ENFORCE_PREFIX = re.compile(r"^\[enforce fail at [^\]]*\]\s*\.?\s*")  # the C++ location torch's checks put first
SENTENCE_END = re.compile(r"(?<=[.;!?])\s")


def torch_refusal(error: BaseException) -> str:
    """Why torch.load refused a file: one line, whole."""
    message = str(error).strip()
    if "PytorchStreamReader failed reading zip archive" in message:
        return UNREADABLE_ZIP
    if message.startswith("Weights only load failed"):
        return "torch's weights_only unpickler refused it: " + _refused_by_weights_only(message)
    if not message or isinstance(error, KeyError):  # a KeyError's text is only the key
        return f"{type(error).__name__}: {message}".rstrip(": ")
    first_line = ENFORCE_PREFIX.sub("", message.splitlines()[0])
    return SENTENCE_END.split(first_line, maxsplit=1)[0]


def _refused_by_weights_only(message: str) -> str:
    """The line of a weights_only refusal that names what it refused (a global, an operand)."""
    for line in message.splitlines():
        line = line.strip()
        if line and not line.startswith(WEIGHTS_ONLY_ADVICE):
            return line
    return "it holds an object torch does not load with weights_only=True"
