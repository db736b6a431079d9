"""Going back from a codec with error feedback (compression/feedback.py `fold_into`):
each slot's residuals are added, once, to that slot's next reduction without the codec,
stage 2's times the ranks (it is kept in averaged units), so nothing the codec held back
is lost. Exact values: the residuals and gradients are small integers in float32."""
import torch

from pipe_horovod.compression.feedback import ErrorFeedback
from pipe_horovod.pipeline.buckets import Bucket

KIND = (torch.float32, torch.device("cpu"))


def _bucket(index=0, names=("a", "b"), numels=(3, 5)):
    return Bucket(index, KIND, list(names), list(numels))


def _feedback():
    """Slot 0 and 1 residuals of one bucket of a (3) and b (5): stage 1 over all 8
    elements, stage 2 over this rank's shard, elements 2..5."""
    fb, bucket = ErrorFeedback(), _bucket()
    for slot in (0, 1):
        fb.residual(slot, bucket).copy_(torch.arange(8.0) + 10 * slot)
        fb.residual(slot, bucket, stage=2, part=(2, 4)).copy_(torch.full((4,), 1.0 + slot))
    return fb, bucket


def _expected(slot, ranks):
    first = torch.arange(8.0) + 10 * slot
    first[2:6] += ranks * (1.0 + slot)
    return first


def test_each_slot_folds_once_at_its_next_use():
    fb, bucket = _feedback()
    flat = torch.ones(8)
    # depth 2, slot 1 next: slot 0's reduction may still be in flight, untouched
    assert fb.fold_into(flat, bucket, 1, 2, 2)
    assert torch.equal(flat, 1 + _expected(1, 2))
    flat = torch.ones(8)
    assert not fb.fold_into(flat, bucket, 0, 2, 2)          # nothing left
    assert torch.equal(flat, 1 + _expected(0, 2))
    flat = torch.ones(8)
    assert not fb.fold_into(flat, bucket, 0, 2, 2)          # folded once only
    assert torch.equal(flat, torch.ones(8))


def test_back_to_k1_folds_every_slot_at_once():
    fb, bucket = _feedback()
    flat = torch.zeros(8)
    assert not fb.fold_into(flat, bucket, 0, 1, 1)          # a sum: stage 2 as kept
    assert torch.equal(flat, _expected(0, 1) + _expected(1, 1))


def test_a_new_bucket_plan_and_a_checkpoint_fold_by_name():
    fb, _ = _feedback()
    saved = ErrorFeedback()
    saved.load(fb.state())
    # b first in a bucket of its own, then a: the same values land on the same names
    b, a = _bucket(0, ("b",), (5,)), _bucket(1, ("a",), (3,))
    flat_b, flat_a = torch.zeros(5), torch.zeros(3)
    assert saved.fold_into(flat_b, b, 0, 2, 4)              # a, and slot 1, to fold
    assert saved.fold_into(flat_a, a, 0, 2, 4)              # slot 1 to fold
    whole = _expected(0, 4)
    assert torch.equal(flat_b, whole[3:]) and torch.equal(flat_a, whole[:3])
    flat_b, flat_a = torch.zeros(5), torch.zeros(3)
    assert saved.fold_into(flat_b, b, 1, 2, 4) and not saved.fold_into(flat_a, a, 1, 2, 4)
    whole = _expected(1, 4)
    assert torch.equal(flat_b, whole[3:]) and torch.equal(flat_a, whole[:3])
