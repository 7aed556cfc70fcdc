"""`jetrl import-model FILE.gguf DIR [--force]`: a GGUF file (a quantized llama.cpp model, say)
as a Hugging Face checkpoint directory a run names in ``[model] hf_path`` (policy/gguf_import.py).
Done once: a DIR that already holds the import of the same file is left as it is."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(args: argparse.Namespace) -> int:
    from jetrl.policy.gguf_import import GGUFImportError, import_gguf, imported_from
    from jetrl.policy.hf import read_config

    out = Path(args.dir)
    before = imported_from(out)
    t0 = time.monotonic()
    try:
        import_gguf(args.file, out, force=args.force)
    except GGUFImportError as e:
        print(f"import-model: {e}")
        return 2
    cfg = read_config(out)
    again = before is not None and not args.force  # else import_gguf refused, or converted
    what = "already holds" if again else f"wrote in {time.monotonic() - t0:.1f} s"
    print(
        f"{out} {what} {Path(args.file).name}: {cfg.family}, {cfg.n_layers} layers, dim {cfg.dim}, "
        f"vocab {cfg.vocab_size}{', tied embeddings' if cfg.tie_embeddings else ''}; "
        f"run it with --model.hf_path={out}"
    )
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "import-model", help="a GGUF file as a Hugging Face checkpoint directory for [model] hf_path (once)"
    )
    p.add_argument("file", help="the .gguf file")
    p.add_argument("dir", help="the checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="convert again even if DIR holds this import")
    p.set_defaults(func=main)
