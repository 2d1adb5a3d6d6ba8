"""benchmarks/bench_op.py measures what its tables say: its implementations (op_impls.py) compute timm's
window attention, with the shift mask and without it (``--no-mask``), and its accuracy
pass (``relative_errors``) reports each one's error against float64 for the output and
every gradient. On the CPU (our kernels under the interpreter), on a small case."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_op  # noqa: E402
import op_impls  # noqa: E402

CASE = (8, 2, 16, 16, 4)  # (B_, H, N, D, nW): 4x4 windows, two images of 2x2 windows
BF16_BOUND = 2e-2  # README's bound for bfloat16 inputs


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("cosine", [False, True], ids=["v1", "cosine"])
@pytest.mark.parametrize("impl", ["eager", "sdpa", "ours"])
def test_implementations_match_float64(impl, cosine, masked):
    inp = op_impls.make_inputs(CASE, cosine, device="cpu", masked=masked)
    errors = bench_op.relative_errors(op_impls.implementation(impl), inp)
    names = ["out", "dqkv", "dtable"] + (["dlogit_scale"] if cosine else [])
    assert sorted(errors) == sorted(f"err_{n}" for n in names)
    assert all(0 <= e < BF16_BOUND for e in errors.values()), errors


def test_relative_errors_sees_a_wrong_implementation():
    """A kernel that drops the mask, or scales the gradient, is reported as far off."""
    inp = op_impls.make_inputs(CASE, False, device="cpu")

    def without_mask(qkv, table, mask, logit_scale, heads, scale):
        return op_impls.eager_math(qkv, table, None, logit_scale, heads, scale)

    def doubled_gradient(qkv, table, mask, logit_scale, heads, scale):
        out = op_impls.eager_math(qkv, table, mask, logit_scale, heads, scale)
        out.register_hook(lambda grad: 2 * grad)
        return out

    assert bench_op.relative_errors(without_mask, inp)["err_out"] > 0.1
    errors = bench_op.relative_errors(doubled_gradient, inp)
    assert errors["err_out"] < BF16_BOUND and errors["err_dqkv"] > 0.9 and errors["err_dtable"] > 0.9


def test_the_mask_free_kernel_refuses_a_mask():
    inp = op_impls.make_inputs(CASE, False, device="cpu")
    with pytest.raises(ValueError, match="no mask"):
        op_impls.fwa_math(inp["qkv"], inp["bias"], inp["mask"], None, inp["heads"], inp["scale"])


def test_family_shapes_have_no_shift_mask():
    """The other families' shapes (nW 0) run without a mask even where masks are asked for."""
    family = [name for name, shape in op_impls.SHAPES.items() if shape[4] == 0]
    assert family and "coatnet_s3_b64" in family
    inp = op_impls.make_inputs((8, 2, 16, 16, 0), False, device="cpu", masked=True)
    assert inp["mask"] is None
    errors = bench_op.relative_errors(op_impls.implementation("ours"), inp)
    assert all(0 <= e < BF16_BOUND for e in errors.values()), errors
