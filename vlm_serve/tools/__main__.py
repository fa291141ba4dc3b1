"""Parse model output from stdin and print what the parser makes of it.

    echo '<|tool_call>call:f{a:1}<tool_call|>' | python -m vlm_serve.tools --format gemma4
    python -m vlm_serve.tools --format gemma3 --stream --tool-names get_weather < output.txt

Prints ``{"content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}``. ``--stream``
feeds the streaming parser one character at a time instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import FORMATS, collect, get_parser


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlm_serve.tools", description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--stream", action="store_true", help="feed the streaming parser 1 char at a time")
    ap.add_argument("--tool-names", help="comma-separated declared function names")
    args = ap.parse_args(argv)

    text = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    names = None
    if args.tool_names is not None:
        names = {n.strip() for n in args.tool_names.split(",") if n.strip()}
    parser = get_parser(args.format)
    if args.stream:
        stream = parser.streaming(names)
        events = [event for ch in text for event in stream.feed(ch)] + stream.finish()
        out = collect(events)
    else:
        out = parser.parse(text, names)
    result = {
        "content": out.content,
        "tool_calls": [{"name": c.name, "arguments": json.loads(c.arguments)} for c in out.tool_calls],
    }
    sys.stdout.buffer.write(json.dumps(result, ensure_ascii=False, indent=2).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
