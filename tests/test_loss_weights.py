"""A micro-batch's share of the step's loss, decided on the device (gradsched.training.loss_weights): one without a
labelled token contributes exact zeros, to the loss and to the gradients, whatever the user's loss does with 0/0."""
import torch

from gradsched.training.loss_weights import gated, weighted


class OneRank:  # what weighted() reads of the plan: a gradient group of one rank
    def group_ranks(self, kind):
        return [0]


def masked_mean(out, target):
    """A user's mean over labelled tokens, written by hand: 0/0 forward and backward when none is labelled."""
    keep = (target != -100).to(out.dtype)
    return ((out.squeeze(-1) - target.clamp(min=0).to(out.dtype)) ** 2 * keep).sum() / keep.sum()


def test_an_all_ignored_micro_batch_gives_exact_zeros_even_where_the_users_loss_is_0_over_0():
    out = torch.randn(2, 3, 1, requires_grad=True)
    loss = weighted(masked_mean, out, torch.full((2, 3), -100), torch.tensor(5.0, dtype=torch.float64), OneRank(),
                    -100)
    loss.backward()
    assert torch.equal(loss.detach(), torch.zeros(()))
    assert torch.equal(out.grad, torch.zeros_like(out))  # not NaN: the user's backward divides by zero


def test_a_labelled_micro_batch_is_its_mean_times_its_share_of_the_global_batch_in_fp64():
    out = torch.randn(2, 3, 1, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, -100, 2], [-100, -100, 3]])
    total = torch.tensor(7.0, dtype=torch.float64)  # labelled tokens of the whole global batch
    loss = weighted(masked_mean, out, target, total, OneRank(), -100)
    loss.backward()
    ref_out = out.detach().clone().requires_grad_()
    ref = masked_mean(ref_out, target) * 3 / 7  # 3 labelled here, 7 in the global batch
    ref.backward()
    # fp64 throughout: equal up to where the share is rounded (x * (3/7) against x * 3 / 7), a few ulps; was
    # compared bitwise, which failed on some draws of `out`
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-15, atol=0)
    torch.testing.assert_close(out.grad, ref_out.grad, rtol=1e-15, atol=0)


def test_a_steps_weights_are_each_micro_batchs_labelled_share_counted_in_one_pass():
    from gradsched.training.loss_weights import StepWeights, labelled, micro_batch_counts
    targets = torch.tensor([[1, 2, -100], [-100, -100, -100], [3, -100, 4], [5, 6, 7]])  # micro-batch 1 of 4 empty
    counts = micro_batch_counts(targets, 4, -100)
    assert counts.tolist() == [labelled(t, -100).item() for t in targets.chunk(4)] == [2, 0, 2, 3]
    weights = StepWeights(counts, counts.sum(), OneRank())
    assert [(bool(keep), w.item()) for keep, w in (weights(i) for i in range(4))] == \
        [(True, 2 / 7), (False, 0.0), (True, 2 / 7), (True, 3 / 7)]
    two = micro_batch_counts(targets, 2, -100)  # micro-batches of two rows each
    assert two.tolist() == [2, 5]


class TwoRanks:  # a gradient group of two ranks: the reduction averages over them
    def group_ranks(self, kind):
        return [0, 1]


def test_weights_scaled_by_another_steps_count_then_k_over_n_give_the_global_mean_and_its_gradient():
    """Two data-parallel ranks, two micro-batches each (one empty), weighted by the previous step's count K (7: not
    this step's 5); their gradients averaged (the reduction), then scaled by step_result's K / N, against one process's
    cross-entropy over the whole batch, in fp64."""
    from gradsched.training.loss_weights import StepWeights, micro_batch_counts, step_result, step_share
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 2, 2, 4, dtype=torch.float64)  # [rank, row (a micro-batch each), token, feature]
    y = torch.tensor([[[0, 1], [2, 1]], [[-100, -100], [1, -100]]])  # 4 and 1 labelled: N = 5
    ce = lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=-100)  # noqa
    scale = torch.tensor(7.0, dtype=torch.float64)
    grads, rows = [], []
    for r in range(2):
        counts = micro_batch_counts(y[r], 2, -100)
        weights = StepWeights(counts, scale, TwoRanks())
        losses = []
        for i, (xi, yi) in enumerate(zip(x[r].chunk(2), y[r].chunk(2))):
            keep, weight = weights(i)
            losses.append(gated(ce, xi @ w, yi, keep, weight))
        g, = torch.autograd.grad(sum(losses), w)
        grads.append(g)
        rows.append((counts.sum(), step_share(losses, TwoRanks(), True), scale))
    counts, shares, scales = (torch.stack(c) for c in zip(*rows))
    loss, factor = step_result(counts, shares, scales, average=True)
    ref = ce(x.flatten(0, 1) @ w, y.flatten(0, 1))
    ref_grad, = torch.autograd.grad(ref, w)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-14, atol=0)
    # fp64 rounding of different summation orders only (a wrong scale is off by 2/7 or more)
    torch.testing.assert_close((grads[0] + grads[1]) / 2 * factor, ref_grad, rtol=1e-12, atol=1e-15)
    assert factor.item() == 7 / 5


def test_a_global_batch_without_a_labelled_token_has_a_nan_loss_and_keeps_its_scale():
    from gradsched.training.loss_weights import next_scale, step_result
    zeros = torch.zeros(2, dtype=torch.float64)
    scale = torch.tensor([7.0, 7.0], dtype=torch.float64)
    loss, factor = step_result(zeros, zeros, scale, average=True)
    assert loss.isnan() and factor.isinf()
    assert next_scale(scale[0], zeros).item() == 7.0


def test_a_first_step_without_a_label_leaves_a_scale_of_one_not_zero():
    """K = 0 (no label in the first step's global batch) would weigh the next step's losses by n / 0."""
    from gradsched.training.loss_weights import StepWeights, next_scale
    weights = StepWeights(torch.zeros(2, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64), OneRank())
    assert [w.item() for _, w in (weights(0), weights(1))] == [0.0, 0.0]
    assert weights.scale().item() == 1.0
    assert next_scale(weights.scale(), torch.zeros(2, dtype=torch.float64)).item() == 1.0


def test_the_gate_in_a_compiled_graph_gives_exact_zeros_even_where_the_users_loss_is_0_over_0():
    import functools
    step = torch.compile(functools.partial(gated, in_graph=True), backend="aot_eager", fullgraph=True)
    out = torch.randn(2, 3, 1, requires_grad=True)
    keep, weight = torch.tensor(False), torch.tensor(0.0, dtype=torch.float64)
    loss = step(masked_mean, out, torch.full((2, 3), -100), keep, weight)
    loss.backward()
    assert torch.equal(loss.detach(), torch.zeros(()))
    assert torch.equal(out.grad, torch.zeros_like(out))
    # and where kept: the loss times its weight, and its gradient, as eagerly
    out.grad = None
    target = torch.tensor([[1, -100, 2], [-100, -100, 3]])
    step(masked_mean, out, target, torch.tensor(True), torch.tensor(0.5, dtype=torch.float64)).backward()
    ref_out = out.detach().clone().requires_grad_()
    (masked_mean(ref_out, target) * 0.5).backward()
    torch.testing.assert_close(out.grad, ref_out.grad, rtol=1e-6, atol=0)


def test_the_eager_gate_takes_any_output_a_leaf_used_twice_or_a_0_d_one_and_weighs_the_loss_once():
    """An output that is a tuple, one of whose tensors feeds the other and another 0-d (an auxiliary loss); and a
    leaf output reused by the next micro-batch (a received buffer returned as is): gradients are the weighted
    loss's, as without the gate, and a gated-off micro-batch leaves the next one's gradient whole."""
    leaf = torch.randn(2, 3, 4, requires_grad=True)
    aux = torch.tensor(0.25, requires_grad=True)
    target = torch.tensor([[1, -100, 2], [-100, 0, 3]])

    def loss_fn(out, t):
        hidden, logits, extra = out
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten()) + hidden.sum() * 0 + extra

    def outputs():
        hidden = leaf * 2
        return hidden, hidden + 1, aux * 3
    for keep, weight in ((torch.tensor([True]), torch.tensor([0.5], dtype=torch.float64)),
                         (torch.tensor([False]), torch.tensor([0.0], dtype=torch.float64))):
        leaf.grad = aux.grad = None
        loss = gated(loss_fn, outputs(), target, keep, weight)
        loss.backward()
        got = leaf.grad.clone(), aux.grad.clone()
        leaf.grad = aux.grad = None
        (loss_fn(outputs(), target) * (0.5 if keep else 0.0)).backward()
        assert torch.equal(loss.detach(), (loss_fn(outputs(), target) * 0.5).detach() if keep else torch.zeros(()))
        assert torch.equal(got[0], leaf.grad) and torch.equal(got[1], aux.grad)
    # the same leaf gated off, then kept: the kept micro-batch's gradient is whole
    leaf.grad = None
    gated(lambda o, t: o.sum(), leaf, target, torch.tensor([False]), torch.tensor([0.0], dtype=torch.float64)).backward()
    gated(lambda o, t: o.sum(), leaf, target, torch.tensor([True]), torch.tensor([1.0], dtype=torch.float64)).backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))


def test_a_loss_that_cannot_be_compiled_whole_runs_eagerly_with_a_warning_and_the_same_gradients():
    import warnings

    import torch.distributed as dist

    import gradsched
    from tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch

    def loss_with_a_graph_break(logits, targets):
        torch._dynamo.graph_break()
        return lm_loss(logits, targets)

    torch.manual_seed(0)
    ref = TinyGPT()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = TinyGPT()
        model.load_state_dict(ref.state_dict())
        pm = gradsched.parallelize(model, plan=gradsched.ParallelPlan.from_world(), loss_fn=loss_with_a_graph_break,
                                   compiler="eager", shard=False)
        x, y = make_batch(2, GPTConfig(), seed=1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = pm.train_step(x, y)
        assert any("loss_fn could not be compiled into the stage's graph" in str(w.message) for w in seen)
        expected = lm_loss(ref(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()


def test_the_last_stages_loss_compiled_by_inductor_gives_the_eager_losses_and_gradients_and_falls_back_with_a_warning():
    """pp > 1: GlobalLoss weighs each micro-batch's loss in one Inductor graph; an empty micro-batch still gives
    exact zeros, and a loss_fn Dynamo cannot trace whole runs eagerly, with a warning, to the same values."""
    import warnings

    from gradsched.training.global_loss import GlobalLoss

    def with_a_graph_break(out, target):
        torch._dynamo.graph_break()
        return masked_mean(out, target)

    targets = torch.tensor([[1, -100, 2], [-100, -100, -100], [3, 0, -100]])  # the second micro-batch: no label
    outs = torch.randn(3, 3, 1, dtype=torch.float64)
    for loss_fn, warns in ((masked_mean, False), (with_a_graph_break, True)):
        compiled, eager = (GlobalLoss(loss_fn, OneRank(), True, -100, compiler) for compiler in ("inductor", "eager"))
        for gl in (compiled, eager):
            gl.begin(targets, 3)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i in range(3):
                got_out, ref_out = (outs[i:i + 1].clone().requires_grad_() for _ in range(2))
                got, ref = compiled(got_out, targets[i:i + 1], i), eager(ref_out, targets[i:i + 1], i)
                got.backward()
                ref.backward()
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
                torch.testing.assert_close(got_out.grad, ref_out.grad, rtol=1e-12, atol=0)
                if i == 1:
                    assert torch.equal(got.detach(), torch.zeros_like(got)) and not got_out.grad.any()
        assert any("loss_fn could not be compiled" in str(w.message) for w in seen) == warns
        assert (compiled._compiled is None) == warns  # the fallback is for good: no retrace a micro-batch
