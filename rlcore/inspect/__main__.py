"""python -m rlcore.inspect <run folder> [--out FILE] [--last N] [--serve [--port P]]

Writes <run>/inspector.html (self-contained: open it in any browser, no network needed), or with
--serve serves the page of the folder, rebuilt at every load (a live run), on 127.0.0.1 behind a
random token, until interrupted (its data as JSON at /data.json, same token).
"""

from __future__ import annotations

import argparse
import sys

from rlcore.inspect.page import write_page
from rlcore.inspect.run_data import RunFolderError
from rlcore.inspect.server import InspectorServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.inspect", description=__doc__.split("\n\n")[1])
    parser.add_argument("folder", help="a run folder: <trainer.output_dir>/<trainer.project>/<trainer.run_name>")
    parser.add_argument("--out", help="where to write the page (default: <folder>/inspector.html)")
    parser.add_argument("--last", type=int, default=200, help="trajectories of the last N sampled steps (default 200)")
    parser.add_argument("--serve", action="store_true", help="serve on 127.0.0.1 with a token instead of writing a file")
    parser.add_argument("--port", type=int, default=0, help="with --serve: the port (default: a free one)")
    args = parser.parse_args(argv)
    try:
        if args.serve:
            try:
                server = InspectorServer(args.folder, args.port, last=args.last)
            except OSError as exc:
                raise ValueError(f"cannot serve on 127.0.0.1:{args.port}: {exc}") from exc
            print(f"serving {args.folder} at {server.url}  (Ctrl-C stops)", flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
            finally:
                server.server_close()
            return 0
        print(write_page(args.folder, args.out, args.last))
        return 0
    except (RunFolderError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
