"""SGLang's frontend language against a radixray server, unchanged: gen, select and fork.

    radixray serve                                # the built-in demo model, port 30000
    python deploy/examples/sglang_frontend.py --url http://127.0.0.1:30000

Install the frontend without its GPU server stack (``pip install sglang`` would pull a CUDA
torch and GBs more), on top of radixray's own dependencies:

    pip install --no-deps sglang==0.5.23
    pip install psutil pybase64 msgspec pyzmq pillow requests aiohttp orjson tqdm ipython triton

The built-in demo model was trained on Python's standard library, so the prompts are Python.
``RuntimeEndpoint`` talks SGLang's native API: GET /get_model_info once, then POST /generate
(``max_new_tokens: 0`` requests cache a shared prefix; ``select`` scores each choice by its
prompt logprobs). Every fork below shares the class header's KV in radixray's radix cache.
"""

from __future__ import annotations

import argparse
import json

import sglang as sgl


@sgl.function
def complete_method(s, name):
    """gen then select: write a method's docstring, then choose what it returns."""
    s += f"    def {name}(self):\n        \"\"\""
    s += sgl.gen("docstring", max_tokens=24, stop=['"""', "\n\n"], temperature=0)
    s += '"""\n        return ' + sgl.select("returns", choices=["None", "self", "True"])


@sgl.function
def class_sketch(s, class_name, methods):
    """fork: one branch per method name, all continuing the same class header."""
    s += f"class {class_name}:\n"
    branches = s.fork(len(methods))
    for branch, method in zip(branches, methods):
        branch += f"    def {method}(self"
        branch += sgl.gen("signature", max_tokens=16, stop="\n", temperature=0.7)
    branches.join()
    for method, branch in zip(methods, branches):
        s += f"    def {method}(self" + branch["signature"] + "\n        pass\n"


def run(url: str) -> dict:
    """Run both programs against ``url``; returns what each variable came out as."""
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    method = complete_method.run(name="close")
    sketch = class_sketch.run(class_name="Reader", methods=["read", "seek", "close"])
    return {"docstring": method["docstring"], "returns": method["returns"],
            "method_text": method.text(), "class_text": sketch.text()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000",
                        help="a radixray server or router")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    out = run(args.url)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"select chose: {out['returns']!r}\n")
    print(out["method_text"], "\n")
    print(out["class_text"])


if __name__ == "__main__":
    main()
