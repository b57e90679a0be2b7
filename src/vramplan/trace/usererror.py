"""Tell a plain mistake in the user's model or inputs from a limit of fake tensors.

A trace fails for two kinds of reasons. The step may depend on values that fake tensors do not
have (``.item()``, data-dependent shapes, a custom op without a fake kernel): the user must
change that line for the trace. Or the step is simply wrong, as it would be on a GPU: a shape
mismatch between the model and its example inputs. Only the first gets the fake-tensor advice.
"""

from __future__ import annotations

import re

_SHAPE = re.compile(
    r"must match the size of tensor|shapes cannot be multiplied|same reduction dim|size mismatch"
    r"|mat1 and mat2|is invalid for input of size|Expected input batch_size|expected input with shape"
    r"|Given groups=\d+, (?:expected )?weight of size|Expected \d+D \(unbatched\) or \d+D \(batched\) input"
    r"|expected input\[.*\] to have \d+ channels|The size of tensor a \(\d+\) must match"
    r"|shape mismatch|Sizes of tensors must match|Dimension out of range|Expected size for first two dimensions",
    re.IGNORECASE,
)
_FAKE = re.compile(r"\bmeta\b|fake|data[- ]dependent|data pointer|\.item\(\)|storage|symbolic|guard",
                   re.IGNORECASE)


def shape_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is a plain shape mismatch, which a GPU run raises too (and not an error
    about fake tensors, their missing values or a missing fake kernel)."""
    if not isinstance(exc, (RuntimeError, ValueError, IndexError)):
        return False
    text = str(exc)
    return bool(_SHAPE.search(text)) and not _FAKE.search(text) and type(exc).__module__ in ("builtins", "torch")


SHAPE_HINT = ("a shape mismatch between the model and its example inputs, as a GPU run would raise too: "
              "check the shapes the factory returns against that line")
