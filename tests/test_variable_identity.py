"""What ranks compare to agree on their variables (pipe_horovod/pipeline/identity.py): paths
renumbered within the list, so a per-process counter offset passes and another order of
layers of one kind is named at its first position. The launches (tensorflow_worker.py's
errors case) check the tape and the optimizer end to end on two ranks."""
import pytest

from pipe_horovod.pipeline import compare_across_ranks
from pipe_horovod.pipeline.identity import comparable_paths, describe_variables


def test_counters_renumbered_within_the_list():
    # The same model, built after two other models on one rank, and loaded by load_model
    # (created outside the model's scope) on another: the same comparison.
    assert comparable_paths(["sequential_2/dense_4/kernel", "sequential_2/dense_5/kernel"]) == \
        comparable_paths(["sequential/dense/kernel", "sequential/dense_1/kernel"]) == \
        comparable_paths(["dense/kernel", "dense_1/kernel"]) == \
        ["dense/kernel", "dense_1/kernel"]
    # Its layers in the other order: different at the first position.
    assert comparable_paths(["sequential_2/dense_5/kernel", "sequential_2/dense_4/kernel"]) == \
        ["dense_1/kernel", "dense/kernel"]
    # Names without a counter, and plain TensorFlow names, stay as they are.
    assert comparable_paths(["conv2d/kernel", "Variable:0", "w"]) == \
        ["conv2d/kernel", "Variable:0", "w"]


def _compare(*descriptions):
    return compare_across_ranks(lambda mine: list(descriptions), descriptions[0])


def test_reordered_variables_are_named_by_position_and_path():
    kernels = [("seq/dense/kernel", (4, 4), "float32", ""),
               ("seq/dense_1/kernel", (4, 4), "float32", "")]
    with pytest.raises(ValueError, match=r"the model differs between ranks: variable 0 is "
                       r"dense_1/kernel, shape \(4, 4\) float32 on rank 1 but "
                       r"dense/kernel, shape \(4, 4\) float32 on rank 0"):
        _compare(describe_variables(kernels), describe_variables(kernels[::-1]))
    _compare(describe_variables(kernels), describe_variables(kernels))     # agreed: no error


def test_first_position_is_the_lowest_number():
    """Positions sort as numbers: with 11 variables, position 2 is named before 10."""
    mine = [(f"v{i}", (1,), "float32", "") for i in range(11)]
    theirs = list(mine)
    theirs[2], theirs[10] = ("x", (1,), "float32", ""), ("y", (1,), "float32", "")
    with pytest.raises(ValueError, match="variable 2 is x, shape"):
        _compare(describe_variables(mine), describe_variables(theirs))


def test_a_local_variable_is_compared_without_its_shape():
    mine = describe_variables([("seq/dense/kernel", None, None, "local")])
    assert mine == {"variable 0": "dense/kernel, local"}


def test_nested_blocks_with_the_same_inner_names_are_told_apart():
    """Two attention blocks hold "query/kernel" each: the last two parts alone compared
    them equal in either order. The shared leading parts (the model's name, which a loaded
    model lacks) are dropped; the blocks' own names stay, renumbered within the list."""
    built = ["transformer_3/mha_4/query/kernel", "transformer_3/mha_5/query/kernel"]
    loaded = ["mha/query/kernel", "mha_1/query/kernel"]
    assert comparable_paths(built) == comparable_paths(loaded) == \
        ["mha/query/kernel", "mha_1/query/kernel"]
    assert comparable_paths(built[::-1]) == ["mha_1/query/kernel", "mha/query/kernel"]
    # A list within one block: its name is shared, so down to layer/weight.
    assert comparable_paths(["model/mha/query/kernel", "model/mha/key/kernel"]) == \
        comparable_paths(["mha/query/kernel", "mha/key/kernel"]) == \
        ["query/kernel", "key/kernel"]
