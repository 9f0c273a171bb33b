"""The megatron-core versions echo_tp.megatron is tested on (no megatron-core import here: the
check runs before any of its internals are touched)."""
from __future__ import annotations

TESTED_VERSIONS = ("0.16.1",)
"""megatron-core versions echo_tp.megatron is tested on (0.16.1: the newest for Python 3.11)."""


def check_version(version: str) -> None:
    """RuntimeError unless `version` is a tested megatron-core version."""
    if version not in TESTED_VERSIONS:
        raise RuntimeError(
            f"echo_tp.megatron is tested on megatron-core {', '.join(TESTED_VERSIONS)}, and "
            f"megatron-core {version} is installed. Echo replaces megatron-core functions by "
            "name (echo_tp/megatron/patches.py) and relies on its layers' call signatures, so "
            "an untested version could run Megatron's collectives instead of Echo's, or none. "
            f"Install a tested one: pip install 'megatron-core=={TESTED_VERSIONS[-1]}' (or "
            "pip install -e '.[megatron]' in echo-tp's checkout).")
