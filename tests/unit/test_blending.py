"""BlendedDataset (Megatron-LM's greedy blend exactly, repeats, determinism, resumable sampling over it) and the
held-out eval split and eval batches (disjoint, deterministic, independent of the DP layout)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from megamoe.data.blending import BlendedDataset, blend_dataset_index
from megamoe.data.eval_split import IGNORE_INDEX, ConcatenatedDataset, eval_batches, split_train_eval
from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.data.token_dataset import TokenDataset
from megamoe.data.training_data import build_train_eval_data, check_data_weights
from tests.helpers.blending import _documents_file


class TaggedDataset:
    """Sample ``i`` of dataset ``tag`` is ``seq_len + 1`` copies of ``tag * 1000 + i`` (inputs and labels)."""

    def __init__(self, tag: int, length: int, seq_len: int = 3):
        self.tag, self.length, self.seq_len = tag, length, seq_len

    def __len__(self) -> int:
        return self.length

    def batch(self, indices):
        indices = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        assert indices.ndim == 1 and bool((indices >= 0).all() and (indices < self.length).all())
        values = (self.tag * 1000 + indices)[:, None].expand(-1, self.seq_len).contiguous()
        return values, values.clone()


def _oracle_choice(weights, num_samples):
    """Megatron-LM's build_blending_indices (megatron/core/datasets/helpers.cpp) restated: position i goes to
    argmax_d w_d * max(i, 1) - count_d, first maximum on ties, w normalised by its float64 sum."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(np.asarray(weights, dtype=np.float64))
    counts = np.zeros(len(w))
    choice = []
    for i in range(num_samples):
        d = int(np.argmax(w * max(i, 1) - counts))
        counts[d] += 1
        choice.append(d)
    return choice


def _decode(blend, indices):
    """(dataset, sample) of each blend index, read back through ``batch``."""
    values = blend.batch(indices)[0][:, 0]
    return [(int(v) // 1000, int(v) % 1000) for v in values]


@pytest.mark.parametrize("weights, num_samples", [
    ([1, 1], 10), ([1, 3], 8), ([0.5, 0.25, 0.25], 100), ([0.2, 0.3, 0.5], 37), ([5, 1, 1, 3], 1000),
    ([1e-3, 1], 50), ([7], 5),
])
def test_blend_counts_follow_the_weights_to_the_sample(weights, num_samples):
    lengths = [4, 9, 2, 6][:len(weights)]
    blend = BlendedDataset([TaggedDataset(d, n) for d, n in enumerate(lengths)], weights, num_samples=num_samples)
    assert blend.dataset_index.tolist() == _oracle_choice(weights, num_samples)
    counts = np.bincount(_oracle_choice(weights, num_samples), minlength=len(weights))
    assert blend.dataset_sample_counts == tuple(counts.tolist()) and sum(blend.dataset_sample_counts) == num_samples
    # Every prefix is balanced (the greedy rule), the total included: below its share + 1, above its share - 2.
    prefix_counts = np.cumsum(np.eye(len(weights))[blend.dataset_index], axis=0)
    positions = np.arange(1, num_samples + 1)[:, None]
    errors = prefix_counts - positions * np.asarray(weights) / np.sum(weights)
    assert np.all(errors < 1) and np.all(errors > -2)


def test_blend_matches_megatron_where_a_greedy_over_i_plus_1_does_not():
    """Megatron-LM's blend of weights [0.3, 0.7] over 8 samples (its helpers.cpp, run side by side): the last
    position goes to dataset 0; a greedy on w_d * (i + 1) - count_d gives it to dataset 1."""
    assert blend_dataset_index([0.3, 0.7], 8).tolist() == [1, 0, 1, 1, 0, 1, 1, 0]
    blend = BlendedDataset([TaggedDataset(0, 5), TaggedDataset(1, 5)], [3, 7], num_samples=8)
    assert blend.dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0] and blend.dataset_sample_counts == (3, 5)


def test_blend_repeats_each_dataset_in_seeded_passes_and_is_deterministic(caplog):
    datasets = [TaggedDataset(0, 3), TaggedDataset(1, 50)]
    with caplog.at_level(logging.INFO, logger="megamoe.data.blending"):
        blend = BlendedDataset(datasets, [0.6, 0.4], num_samples=20, seed=7)
    assert "blend dataset 0: 12 of 20 samples" in caplog.text and "blend dataset 1: 8 of 20 samples" in caplog.text
    decoded = _decode(blend, range(len(blend)))
    assert [d for d, _ in decoded] == blend.dataset_index.tolist()
    small = [i for d, i in decoded if d == 0]  # 12 samples of a 3-sample dataset: four passes, each a permutation
    passes = [small[k:k + 3] for k in range(0, 12, 3)]
    assert all(sorted(p) == [0, 1, 2] for p in passes) and len({tuple(p) for p in passes}) > 1
    large = [i for d, i in decoded if d == 1]  # 8 of 50: distinct, and a seeded subset rather than the first 8
    assert len(set(large)) == 8 and sorted(large) != list(range(8))

    again = BlendedDataset(datasets, [0.6, 0.4], num_samples=20, seed=7)
    assert _decode(again, range(20)) == decoded
    other = BlendedDataset(datasets, [0.6, 0.4], num_samples=20, seed=8)
    assert other.dataset_index.tolist() == blend.dataset_index.tolist() and _decode(other, range(20)) != decoded
    # batch() keeps the requested order, repeats included, across datasets.
    assert _decode(blend, [19, 0, 19, 4]) == [decoded[19], decoded[0], decoded[19], decoded[4]]



@pytest.mark.parametrize("weights", ([1, 1], [3, 50], [0.1, 0.7, 0.2], [1e-3, 1, 5]))
def test_default_size_sees_every_dataset_whole(weights):
    lengths = [3, 50, 7][:len(weights)]
    blend = BlendedDataset([TaggedDataset(d, n) for d, n in enumerate(lengths)], weights)
    counts = np.asarray(blend.dataset_sample_counts)
    assert np.all(counts >= lengths)  # every dataset at least one full pass
    one_fewer = np.bincount(blend_dataset_index(weights, len(blend) - 1), minlength=len(weights))
    assert np.any(one_fewer < lengths)  # and no blend sample more than that needs
    size_needed = np.asarray(lengths) / (np.asarray(weights) / np.sum(weights))
    limiting = int(np.argmax(size_needed))
    assert counts[limiting] - lengths[limiting] <= 1  # the dataset shortest for its weight is seen about once
    decoded = _decode(blend, range(len(blend)))
    for d, length in enumerate(lengths):
        assert {i for t, i in decoded if t == d} == set(range(length))
    if weights == [3, 50]:
        assert len(blend) == 53  # weights proportional to the lengths: the datasets' total, each seen once


def test_blend_validation():
    datasets = [TaggedDataset(0, 3), TaggedDataset(1, 5)]
    for weights, message in (([1], "1 weights for 2 datasets"), ([1, 0], r"weights\[1\] must be a positive finite"),
                             ([1, -2], r"weights\[1\]"), ([float("nan"), 1], r"weights\[0\]"),
                             ([1, float("inf")], r"weights\[1\]"), ([True, 1], r"weights\[0\]")):
        with pytest.raises(ValueError, match=message):
            BlendedDataset(datasets, weights, num_samples=4)
    with pytest.raises(ValueError, match="at least one dataset"):
        BlendedDataset([], [], num_samples=4)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        BlendedDataset(datasets, [1, 1], num_samples=0)
    with pytest.raises(ValueError, match="share one seq_len"):
        BlendedDataset([TaggedDataset(0, 3, seq_len=4), TaggedDataset(1, 3)], [1, 1])
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        BlendedDataset(datasets, [1, 1], num_samples=4).batch([4])
    with pytest.raises(ValueError, match="num_samples"):
        blend_dataset_index([1.0], 0)


def _run(blend, steps, *, dp_size, micro_batch_size, start=None):
    """Per step, the decoded samples of every DP rank's micro-batches in rank order, and the final state."""
    samplers = [ResumableSampler(len(blend), global_batch_size=8, micro_batch_size=micro_batch_size, dp_rank=rank,
                                 dp_size=dp_size, seed=3) for rank in range(dp_size)]
    for sampler in samplers:
        if start is not None:
            sampler.load_state_dict(start)
    steps_out = []
    for _ in range(steps):
        steps_out.append([pair for sampler in samplers for mb in sampler.next_micro_batches()
                          for pair in _decode(blend, mb)])
    return steps_out, samplers[0].state_dict()


def test_resumable_sampler_over_a_blend_resumes_exactly():
    blend = BlendedDataset([TaggedDataset(0, 5), TaggedDataset(1, 7), TaggedDataset(2, 4)], [3, 2, 1],
                           num_samples=6 * 8, seed=1)
    whole, _ = _run(blend, 6, dp_size=1, micro_batch_size=8)
    assert sorted(pair for step in whole for pair in step) == sorted(_decode(blend, range(len(blend))))
    assert sum(pair[0] == 0 for step in whole for pair in step) == blend.dataset_sample_counts[0] == 24
    first, state = _run(blend, 2, dp_size=2, micro_batch_size=2)
    assert first == whole[:2]
    for dp_size, micro_batch_size in ((1, 8), (4, 1), (2, 4)):
        resumed, _ = _run(blend, 4, dp_size=dp_size, micro_batch_size=micro_batch_size, start=state)
        assert resumed == whole[2:], (dp_size, micro_batch_size)


def _stream(part):
    """Every token of a split side, in its order (seq_len 1: inputs are the stream, the last label ends it)."""
    inputs, labels = part.batch(range(len(part)))
    return inputs[:, 0].tolist() + labels[-1:, 0].tolist()


def _document_ids(tokens):
    """Runs of one document's id in a stream of 'every token of document d is d + 1' files, EOS (0) dropped."""
    return [t - 1 for i, t in enumerate(tokens) if t and (i == 0 or tokens[i - 1] != t)]


def test_eval_split_holds_out_seeded_random_documents_of_a_sorted_corpus(tmp_path):
    """60 documents sorted by topic, the last 10 off-topic (a tail split's whole eval set): the held-out
    documents come from everywhere, whole, in a seeded random order; the same seed gives the same split,
    as a Megatron dataset of the same documents does; nothing is lost or shared."""
    from tests.helpers.indexed_dataset import write_megatron

    documents = [[d + 1] * (2 + d % 4) for d in range(60)]  # every token of document d is d + 1
    path = _documents_file(tmp_path / "sorted.bin", documents)
    train, held_out = split_train_eval(TokenDataset(path, 1), 0.2, seed=3)
    eval_documents, train_documents = _document_ids(_stream(held_out)), _document_ids(_stream(train))
    assert len(eval_documents) == 60 - round(0.8 * 60) == 12                 # Megatron's count for (0.8, 0.2)
    assert sorted(eval_documents + train_documents) == list(range(60))      # each document on one side, whole
    assert train_documents == sorted(train_documents) and eval_documents != sorted(eval_documents)
    assert len([d for d in eval_documents if d >= 50]) < 6 and min(eval_documents) < 30  # not the off-topic tail
    for side, ids in ((held_out, eval_documents), (train, train_documents)):  # whole documents, each with its EOS
        assert _stream(side) == [t for d in ids for t in documents[d] + [0]][:side.num_tokens]
    again = split_train_eval(TokenDataset(path, 1), 0.2, seed=3)[1]
    assert _stream(again) == _stream(held_out)
    assert _document_ids(_stream(split_train_eval(TokenDataset(path, 1), 0.2, seed=4)[1])) != eval_documents
    write_megatron(tmp_path / "meg", [[document[:1], document[1:] + [0]] for document in documents], 4)
    assert _stream(split_train_eval(TokenDataset(tmp_path / "meg", 1), 0.2, seed=3)[1]) == _stream(held_out)

    # Windows of a longer seq_len stay inside their side: no eval label is a training input or label.
    train, held_out = split_train_eval(TokenDataset(path, 4), 0.2, seed=3)
    train_tokens = set(torch.cat(train.batch(range(len(train)))).flatten().tolist()) - {0}
    assert not train_tokens & set(held_out.batch(range(len(held_out)))[1].flatten().tolist())
    with pytest.raises(IndexError):
        held_out.batch([len(held_out)])


def test_eval_split_refuses_what_it_cannot_hold_out(tmp_path):
    dataset = TokenDataset(_documents_file(tmp_path / "d.bin", [[5, 6, 7]] * 10), 2)
    for bad in (0, 1, -0.5, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="eval_fraction must be a number in \\(0, 1\\)"):
            split_train_eval(dataset, bad, seed=0)
    assert [len(part) for part in split_train_eval(dataset, 0.01, seed=0)] == [17, 1]  # at least one each way
    assert [len(part) for part in split_train_eval(dataset, 0.99, seed=0)] == [1, 17]
    one = TokenDataset(_documents_file(tmp_path / "one.bin", [list(range(1, 30))]), 2)
    with pytest.raises(ValueError, match="has 1 document\\(s\\) and needs at least 2"):
        split_train_eval(one, 0.1, seed=0)
    no_eos = TokenDataset(_documents_file(tmp_path / "no_eos.bin", [[5, 6, 7]] * 10, append_eos=False), 2)
    with pytest.raises(ValueError, match="cannot hold out whole documents: .*no_eos.bin records no document "
                                         "boundaries.*--eval-data"):
        split_train_eval(no_eos, 0.1, seed=0)
    short = TokenDataset(_documents_file(tmp_path / "short.bin", [[5]] * 20), 8)   # 2 tokens a document
    with pytest.raises(ValueError, match="the eval side of --eval-fraction 0.1 \\(2 of 20 documents held out\\) has "
                                         "4 tokens, too few for one sample of seq_len 8"):
        split_train_eval(short, 0.1, seed=0)
    with pytest.raises(ValueError, match="the training side of --eval-fraction 0.9 \\(18 of 20 documents held "
                                         "out\\) has 4 tokens"):
        split_train_eval(short, 0.9, seed=0)


def _eval_stream(dataset, *, dp_size, micro_batch_size, global_batch_size, num_samples=None):
    """All ranks' eval micro-batches: per step, rank-major; checks shapes and step counts agree over ranks."""
    per_rank = [list(eval_batches(dataset, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                  dp_rank=rank, dp_size=dp_size, num_samples=num_samples)) for rank in range(dp_size)]
    assert len({len(steps) for steps in per_rank}) == 1
    micro_batches = []
    for step in range(len(per_rank[0])):
        for rank in range(dp_size):
            assert len(per_rank[rank][step]) == global_batch_size // (dp_size * micro_batch_size)
            for inputs, labels in per_rank[rank][step]:
                assert inputs.shape == labels.shape == (micro_batch_size, dataset.seq_len)
                micro_batches.append((inputs, labels))
    return micro_batches


def test_eval_batches_cover_every_sample_once_whatever_the_layout():
    dataset = ConcatenatedDataset([TaggedDataset(1, 5), TaggedDataset(2, 6)])  # 11 eval samples
    expected = [(1, i) for i in range(5)] + [(2, i) for i in range(6)]
    statistics = set()
    for dp_size, micro_batch_size, global_batch_size in ((1, 1, 1), (1, 4, 4), (2, 2, 8), (4, 1, 4), (4, 2, 16),
                                                         (2, 3, 12)):
        micro_batches = _eval_stream(dataset, dp_size=dp_size, micro_batch_size=micro_batch_size,
                                     global_batch_size=global_batch_size)
        labels = torch.cat([labels for _, labels in micro_batches])
        real = labels[:, 0] != IGNORE_INDEX
        assert bool((labels[~real] == IGNORE_INDEX).all())  # padding rows are wholly ignored
        assert [(int(v) // 1000, int(v) % 1000) for v in labels[real, 0]] == expected, (dp_size, micro_batch_size)
        kept = labels[labels != IGNORE_INDEX].double()
        statistics.add((kept.numel(), float(kept.sum())))  # what a token-weighted eval loss reduces
        padding_inputs = torch.cat([inputs for inputs, _ in micro_batches])[~real]
        assert bool((padding_inputs == 1000).all())  # padding reads sample 0, a valid window
    assert len(statistics) == 1
    first_three = _eval_stream(dataset, dp_size=2, micro_batch_size=1, global_batch_size=2, num_samples=3)
    kept = torch.cat([labels for _, labels in first_three])[:, 0]
    assert kept[kept != IGNORE_INDEX].tolist() == [1000, 1001, 1002]
    with pytest.raises(ValueError, match="multiple of dp_size"):
        next(eval_batches(dataset, global_batch_size=6, micro_batch_size=4, dp_rank=0, dp_size=1))
    with pytest.raises(ValueError, match="dp_rank"):
        next(eval_batches(dataset, global_batch_size=4, micro_batch_size=2, dp_rank=2, dp_size=2))
    with pytest.raises(ValueError, match="num_samples must be in \\[1, len\\(dataset\\) = 11\\]"):
        next(eval_batches(dataset, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=2, num_samples=12))
    with pytest.raises(ValueError, match="share one seq_len"):
        ConcatenatedDataset([TaggedDataset(0, 2), TaggedDataset(1, 2, seq_len=5)])


# ---------------------------------------------------------------- the run's datasets from --data


def test_check_data_weights():
    assert check_data_weights(["a", "b"], None) is None
    assert check_data_weights(["a", "b"], [3, 0.5]) == [3.0, 0.5]
    for paths, weights, message in ((["a"], [1, 2], "2 weight\\(s\\) for 1 --data path"), ([], None, "at least one"),
                                    (["a"], [0], "weight 0 of a"), (["a"], [-1.0], "positive"),
                                    (["a"], [float("nan")], "positive")):
        with pytest.raises(ValueError, match=message):
            check_data_weights(paths, weights)


def test_build_train_eval_data_blends_splits_and_checks(tmp_path):
    from tests.helpers.indexed_dataset import write_megatron

    _documents_file(tmp_path / "a.bin", [[d + 1] * 3 for d in range(20)])  # 80 tokens: 19 samples of seq_len 4
    write_megatron(tmp_path / "m", [[[50 + d] * 3 + [0]] for d in range(10)], 4)  # 40 tokens: 9 samples
    single = build_train_eval_data([str(tmp_path / "a.bin")], seq_len=4, vocab_size=100)
    assert isinstance(single.train, TokenDataset) and single.eval is None and len(single.train) == 19

    data = build_train_eval_data([tmp_path / "a.bin", tmp_path / "m"], weights=[3, 1], seq_len=4,
                                 vocab_size=100, num_samples=16, eval_fraction=0.2, seed=5)
    assert isinstance(data.train, BlendedDataset) and data.train.dataset_sample_counts == (12, 4)
    assert [source.source.format for source in data.sources] == ["megamoe", "megatron"]
    # 4 of a's 20 documents (16 tokens: 3 samples) and 2 of m's 10 (8 tokens: 1 sample), chosen by the seed.
    eval_inputs, eval_labels = data.eval.batch(range(len(data.eval)))
    assert len(data.eval) == 4 and eval_inputs[:3].max() < 50 and min(set(eval_inputs[3].tolist()) - {0}) >= 50
    assert data.eval.batch(range(4))[0].tolist() == build_train_eval_data(
        [tmp_path / "a.bin", tmp_path / "m"], seq_len=4, vocab_size=100, eval_fraction=0.2, seed=5).eval.batch(
        range(4))[0].tolist()                                                       # the seed decides, not the blend
    train_tokens = set(torch.cat(data.train.batch(range(len(data.train)))).flatten().tolist())
    assert not train_tokens & set(eval_labels.flatten().tolist()) - {0}  # held out before blending: no overlap

    unweighted = build_train_eval_data([str(tmp_path / "a.bin"), str(tmp_path / "m")], seq_len=4, vocab_size=100,
                                       eval_paths=[str(tmp_path / "m")])
    assert unweighted.train.dataset_sample_counts == (19, 9) and len(unweighted.eval) == 9  # weights = sizes
    with pytest.raises(ValueError, match="not both"):
        build_train_eval_data([str(tmp_path / "a.bin")], seq_len=4, vocab_size=100, eval_fraction=0.1,
                              eval_paths=[str(tmp_path / "m")])
    with pytest.raises(ValueError, match="token 20 is id 55, outside the vocabulary \\[0, 55\\)"):
        build_train_eval_data([str(tmp_path / "m")], seq_len=4, vocab_size=55)
