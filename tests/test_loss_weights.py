"""A micro-batch's share of the step's loss, decided on the device (gradsched.training.loss_weights): one without a
labelled token contributes exact zeros, to the loss and to the gradients, whatever the user's loss does with 0/0."""
import torch

from gradsched.training.loss_weights import weighted


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
