"""A patched model against timm's, judged as ``verify`` judges it, for tests that run the
models themselves (torch.compile of the patched model; models timm's factory cannot make
small): each run's output and gradients against a float64 copy's, with timm's own float32
error (the larger of two draws: the images moved by one ulp, ``jitter_images``) as the
yardstick."""
import contextlib
import copy
import io
from collections import Counter
from typing import Dict, Iterator, Iterable, List, Optional, Tuple, Type, Union

import timm
import torch
from torch import nn

from model_cases import flashwin_ops, images, recording_backend
from opcases import kernels_launched
from timm_flashwin.ops import dispatch
from timm_flashwin import is_patched, patch_model, patch_report, unpatch_model
from timm_flashwin.tools.comparison import Comparison, compare, group_error, jitter_images, larger_error
from timm_flashwin.tools.verify import GRADIENT_FACTOR, verify_model

#: one run: (output, {parameter name: gradient})
Run = Tuple[torch.Tensor, Dict[str, torch.Tensor]]


def judge(ours: Run, timm_run: Run, reference: Run, again: Run) -> List[Comparison]:
    """The failed comparisons (verify's rule, float32 tolerances) of the patched model's run
    against timm's, the float64 copy's and timm's second (jittered) one."""
    (our_out, our_grads), (timm_out, timm_grads), (ref, ref_grads), (again_out, again_grads) = (
        ours, timm_run, reference, again)
    floor = larger_error(group_error(timm_grads, ref_grads), group_error(again_grads, ref_grads))
    checks = [compare("<output>", our_out, timm_out, ref, 1e-4, 1e-6, timm_again=again_out)]
    checks += [compare(n, our_grads[n], timm_grads[n], ref_grads[n], 1e-4, 1e-6, floor, GRADIENT_FACTOR,
                       again_grads[n]) for n in ref_grads]
    assert len(checks) == len(ref_grads) + 1 and set(our_grads) == set(ref_grads)
    return [c for c in checks if not c.passed]


#: the attention kernels' forward launches: one per patched module's call
FORWARD_KERNELS = ("window_attention_fwd_kernel", "local_attention_fwd_kernel")


def training_step_runs(model: nn.Module, ours: nn.Module, x: torch.Tensor) -> List[Run]:
    """One backward of a fixed random output gradient each, in ``judge``'s order: the patched
    model ``ours``, timm's ``model``, a float64 copy of it and ``model`` again on the images
    moved by one ulp (``jitter_images``). The patched run must have run the kernels: one
    forward kernel launched per patched module, and a backward kernel for each (a module that
    quietly computed in PyTorch fails here, whatever its output)."""
    runs = []
    for net, x_in in ((ours, x), (model, x), (copy.deepcopy(model).double(), x.double()), (model, jitter_images(x))):
        net.zero_grad(set_to_none=True)
        with kernels_launched() as launched:
            out = net(x_in)
            forward = len(launched)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
        if net is ours:
            patched = len(patch_report(ours).patched)
            assert patched and sum(launched[:forward].count(k) for k in FORWARD_KERNELS) == patched, launched
            assert sum("_bwd_" in k for k in launched[forward:]) >= patched, launched
        else:
            assert not launched, launched
        runs.append((out.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}))
    return runs


def gradient_transform_failures(model: nn.Module, x: torch.Tensor) -> List[Comparison]:
    """``training_step_runs`` through torch.func: each run's parameter gradients by
    ``torch.func.vjp`` of ``functional_call`` (the same fixed output gradient), a patched
    copy of ``model`` against timm's, judged (``judge``). The patched run calls an operator
    once per patched module, through its ``autograd.Function`` (``dispatch.call_operator``)."""
    ours = patch_model(copy.deepcopy(model), strict=True)
    runs = []
    for net, x_in in ((ours, x), (model, x), (copy.deepcopy(model).double(), x.double()), (model, jitter_images(x))):
        params = {n: p.detach() for n, p in net.named_parameters()}
        with counting_transform_calls() as calls:
            out, vjp = torch.func.vjp(lambda p: torch.func.functional_call(net, p, (x_in,)), params)
            grads, = vjp(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
        # one operator call a patched module: the window one, or the local one (Hiera's pooling blocks)
        ops = calls["window_attention_fwd"] + calls["local_attention_fwd"]
        assert ops == (len(patch_report(ours).patched) if net is ours else 0)
        runs.append((out.detach(), grads))
    return judge(*runs)


@contextlib.contextmanager
def counting_transform_calls() -> Iterator[Counter]:
    """Counts the forward calls of each registered operator's torch.func Function, by name
    (its ``apply`` is entered twice a call: torch.func applies it again one level down)."""
    calls: Counter = Counter()
    functions = [(op._opoverload._opname, function, function.__dict__["forward"])
                 for op, function in dispatch._FOR_TRANSFORMS.items()]
    def counting(name, forward):  # no keyword arguments: torch.func reads the signature
        def counted(*inputs):
            calls[name] += 1
            return forward(*inputs)
        return staticmethod(counted)

    for name, function, forward in functions:
        function.forward = counting(name, forward.__func__)
    try:
        yield calls
    finally:
        for _, function, forward in functions:
            function.forward = forward


def compiled_against_timm(model: nn.Module, device: str = "cuda", backend: str = "inductor",
                          ops_per_graph: Optional[int] = None) -> List[Comparison]:
    """torch.compile(fullgraph=True) of a patched copy of ``model`` (perturbed, float32;
    strict): its eval output, then a training step's gradients, judged (``judge``); the compiled
    graphs call the op once per patched module. Not against the eager patched model:
    inductor rounds the other layers otherwise, and perturbed models amplify rounding (H200,
    torch 2.11: maxvit_tiny's eval logits moved by up to 3e-3 between the compiled and the
    eager patched model, coatnet_0's gradient of a first-stage norm weight by 16%).
    ``ops_per_graph``: the op calls each graph holds where not one per patched module."""
    torch._dynamo.reset()
    model = model.to(device)
    reference, again_model = copy.deepcopy(model).double(), copy.deepcopy(model)  # BatchNorm: each its own stats
    patched_model = patch_model(copy.deepcopy(model), strict=True)
    graphs: List = []
    compiled = torch.compile(patched_model, fullgraph=True, backend=recording_backend(graphs, backend))
    x = images(4, model.pretrained_cfg["input_size"][1:], device=device)
    runs = []
    for net, params, images_in in ((compiled, patched_model, x), (model, model, x), (reference, reference, x.double()),
                                   (again_model, again_model, jitter_images(x))):
        with torch.no_grad():
            evaluated = net.eval()(images_in)
        torch.manual_seed(0)
        net.train()(images_in).square().mean().backward()
        runs.append((evaluated, {n: p.grad for n, p in params.named_parameters() if p.grad is not None}))
    expected = len(patch_report(patched_model).patched) if ops_per_graph is None else ops_per_graph
    assert graphs and all(flashwin_ops([g]) == expected for g in graphs) and (expected > 0 or ops_per_graph == 0)
    return judge(*runs)



@contextlib.contextmanager
def patched_in_place(model: nn.Module, x: torch.Tensor, patched: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Under no_grad: ``model`` patched in place (strict), which keeps its state_dict's keys
    and values; a deepcopy and a torch.save / torch.load of it patch ``patched`` modules
    and compute its output. Yields (timm's output, the patched output) for the caller's
    own checks of the patched model, then unpatches it and checks timm's output again."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(x)
        patch_model(model, strict=True)
        assert list(model.state_dict()) == list(before)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        patched_out = model(x)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
            assert len(patch_report(other).patched) == patched and torch.equal(other(x), patched_out)
        yield expected, patched_out
        unpatch_model(model)
        assert not is_patched(model) and torch.equal(model(x), expected)


def full_resolution_passes(name: str, dtype: str, batch: int = 2, kept: Optional[int] = None) -> None:
    """verify's AMP training run of ``name`` at its full resolution on the GPU (``dtype``
    "bfloat16" or "float16"): it passes verify's rule and ran the kernels; where ``kept``
    is given, every attention module verify compares but ``kept`` of them is patched; and
    its top-1 agreement with float64 is within half a point of timm's own (perturbed
    models are chaotic in low precision: top-1 is judged against timm's)."""
    result = verify_model(name, batch=batch, dtype=dtype, device="cuda", train=True)
    assert result.passed, "\n".join(map(str, result.failures()[:10]))
    assert result.backend == "triton"
    if kept is not None:
        assert result.patched_modules == len(result.layers) - kept > 0
    assert result.top1_ours_vs_float64 >= result.top1_timm_vs_float64 - 0.5


def every_model_patched(names: Iterable[str], attention: Union[Type[nn.Module], Tuple[Type[nn.Module], ...]],
                        families: Iterable[str]) -> Iterator[Tuple[str, nn.Module]]:
    """Each model ``names`` names that has modules of the ``attention`` classes, built on the
    meta device and patched strictly: every such module patched, of one of ``families``,
    nothing skipped, and unpatched again to timm's own classes. Yields (name, patched model)
    for a family's own checks; at least one model of the names must have the modules (what we
    serve, not how many models timm has)."""
    names, families, served = list(names), set(families), 0
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name)
        if not any(isinstance(m, attention) for m in model.modules()):
            continue
        report = patch_report(patch_model(model, strict=True))
        assert report.modules and not report.skipped, name
        assert {m.family for m in report.modules} <= set(families), name
        assert all(is_patched(m) for m in model.modules() if isinstance(m, attention)), name
        yield name, model
        assert not any(is_patched(m) for m in unpatch_model(model).modules()), name
        served += 1
    assert served, f"no model among {names} has {attention} modules"
