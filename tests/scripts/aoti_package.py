"""AOTInductor in a process of its own: export, compile into a package, load, run, compare.

``python tests/scripts/aoti_package.py FAMILY`` does it for a patched model of
tests/test_tools.py's FAMILIES (the op in the exported graph, timm's outputs from the
package); ``... control`` for a model of two torch ops, which tells a loader that crashes
on this machine (a segmentation fault: the process dies, hence a process) from ours.
Prints "compiled" once the package is built, and exits 0 with "ok" printed when the package
computes the eager outputs."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import torch  # noqa: E402

from test_tools import OP, graph_targets, images, pair  # noqa: E402


class Control(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def main(family: str) -> None:
    if family == "control":
        plain = model = Control()
        x = torch.randn(4, 3, 32, 32, device="cuda")
    else:
        plain, model = pair(family)
        x = images(model, batch=4)
    with torch.no_grad():
        program = torch.export.export(model, (x,))
        if family != "control":
            assert sum(t.startswith(OP) for t in graph_targets(program.graph_module)) == 4
        with tempfile.TemporaryDirectory() as tmp:
            path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tmp, "model.pt2"))
            print("compiled", flush=True)
            compiled = torch._inductor.aoti_load_package(path)
            torch.testing.assert_close(compiled(x), plain(x), rtol=1e-4, atol=1e-4)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
