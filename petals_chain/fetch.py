"""``python -m petals_chain.fetch [NAME ...]``: fetch known models into the models directory.

Without a name, fetches every known model. ``--list`` shows them and whether each is present.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from petals_chain.swarm.console import say
    from petals_chain.swarm.registry import REGISTRY, ModelNotFetched, fetch, models_dir, registry_path, sha256_of

    p = argparse.ArgumentParser(prog="python -m petals_chain.fetch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"short model names ({', '.join(sorted(REGISTRY))})")
    p.add_argument("--list", action="store_true", help="list known models and where they are")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.list:
        say(f"models directory: {models_dir()}")
        for name, entry in sorted(REGISTRY.items()):
            try:
                where = str(path := registry_path(name))
                if sha256_of(path) != entry.sha256:  # a truncated or damaged copy was listed as if fetched
                    where += f"  (damaged: SHA-256 differs; fetch it again: python -m petals_chain.fetch {name})"
            except ModelNotFetched:
                where = "not fetched"
            except OSError as e:  # another user's file or dir in a shared models dir: the check was a traceback
                where = f"{models_dir() / entry.filename}  (cannot be read: {e.strerror or e})"
            say(f"  {name:<16} {where}\n  {'':<16} {entry.description}")
        return 0
    unknown = [n for n in args.names if n not in REGISTRY]
    if unknown:
        print(f"error: unknown model(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(REGISTRY))}",
              file=sys.stderr)
        return 2
    for name in args.names or sorted(REGISTRY):
        try:
            path = fetch(name, quiet=args.quiet)
        except (RuntimeError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # was a traceback; the partial download went with fetch's temp dir
            print(f"interrupted: {name} not fetched", file=sys.stderr)
            return 130
        say(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
