"""Weight files as every layer reads them: a damaged ``*.safetensors`` is named before anything loads.

``check_safetensors(folder)`` opens each file's header (a few KiB, no tensor is read): a truncated file or
one with a garbage header is a ``ValueError`` naming the file and what the safetensors reader said,
where it was a ``SafetensorError`` traceback. Imports nothing of infir2 (like ``_dist``, ``_logging``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["check_safetensors"]


def check_safetensors(folder: str | Path) -> None:
    """Every ``*.safetensors`` of ``folder`` has a readable header covering the file, or ``ValueError``."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError (not a ValueError) or OSError
            raise ValueError(f"{path} is damaged ({e}): copy it again or point at another folder") from None
