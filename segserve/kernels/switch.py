"""A process-wide on/off switch for one compiled kernel family, read from the environment once.

``SEGSERVE_CPU_KERNELS``, ``SEGSERVE_AMX``, ``SEGSERVE_BF16GEMM``, ``SEGSERVE_CHUNK_ATTENTION``,
``SEGSERVE_QUANT`` and ``SEGSERVE_QUANT_INT8`` each name one: a value of 0/false/off/no turns that
family off for the process, anything else turns it on; unset leaves the family's default (on).
Benchmarks and tests flip a switch at run time with :meth:`Switch.set` or ``with switch.off():``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_OFF = ("0", "false", "off", "no")


def env_on(var: str, default: bool = True) -> bool:
    """Whether the environment leaves ``var`` on: not one of 0/false/off/no (unset: ``default``)."""
    value = os.environ.get(var)
    if value is None:
        return default
    return value.strip().lower() not in _OFF


class Switch:
    """One kernel family's switch: starts at :func:`env_on` of ``var`` (``default`` when unset); :attr:`on`
    is the setting."""

    def __init__(self, var: str, default: bool = True) -> None:
        self.var = var
        self.on = env_on(var, default)

    def __bool__(self) -> bool:
        return self.on

    def set(self, flag: bool) -> bool:
        """Set the switch for this process; returns the previous setting."""
        old, self.on = self.on, bool(flag)
        return old

    @contextmanager
    def off(self) -> Iterator[None]:
        """``with switch.off():`` runs with the family off, then restores the previous setting."""
        old = self.set(False)
        try:
            yield
        finally:
            self.set(old)

    def off_reason(self) -> str:
        """The line that says this switch is why the family is off."""
        return f"switched off ({self.var}=0 or set_enabled(False))"
