"""``keyed(randomness=keyinit.nn.Randomness(...))``, the one policy value, keys exactly as the deprecated
``index=``/``calls=``/``host_random=`` keywords it replaces, which still work and warn with the new spelling."""

import itertools
import random
import warnings

import attrs
import numpy as np
import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.nn import Randomness


class Twice(nn.Module):
    """One dropout module run twice (its call numbering matters), then a draw from each host generator."""

    def __init__(self, host_draws: bool) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.host_draws = host_draws

    def forward(self, x):
        y = self.drop(self.drop(x))
        if self.host_draws:
            y = y * (1.0 + random.random()) + float(np.random.rand())
        return y


def _outcome(rows: int, host_draws: bool, **keywords):
    """The forward's output (masks scaled by the host draws), or the error it raised (type, message)."""
    model = Twice(host_draws).train()
    try:
        with knn.keyed(model, 11, step=3, sample_offset=5, **keywords):
            return model(torch.ones(rows, 64))
    except Exception as exc:  # compared, not hidden: the two spellings must raise the same
        return type(exc), str(exc)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


OLD = [dict((k, v) for k, v in zip(("index", "calls", "host_random"), values) if v is not None)
       for values in itertools.product(("tracked", "dim0"), (None, "forward", "execution"),
                                       (None, "sample", "forward", "replicated"))]


def _new(index=None, calls=None, host_random=None) -> Randomness:
    fields = {"index": index, "calls": calls,
              "host": {"forward": "rows"}.get(host_random, host_random)}
    return Randomness(**{k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize("old", OLD, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_old_keywords_key_as_the_policy_bitwise(old):
    for rows, host_draws in ((4, False), (1, True), (4, True)):
        with pytest.warns(DeprecationWarning):
            before = _outcome(rows, host_draws, **old)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # the new spelling warns nothing
            after = _outcome(rows, host_draws, randomness=_new(**old))
        assert _same(before, after), (old, rows, host_draws, before, after)


def test_the_choices_change_values():
    """The equivalence above compares values that differ between policies (it could fail)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        default = _outcome(4, False)
        assert isinstance(default, torch.Tensor)
        assert torch.equal(default, _outcome(4, False, randomness=Randomness()))
        assert not torch.equal(default, _outcome(4, False, randomness=Randomness(calls="execution")))
        one = {host: _outcome(1, True, randomness=Randomness(host=host)) for host in ("sample", "rows", "replicated")}
        assert not torch.equal(one["sample"], one["replicated"])
        four = {host: _outcome(4, True, randomness=Randomness(host=host)) for host in ("sample", "rows", "replicated")}
        assert four["sample"][0] is keyinit.UnkeyedRandomnessError  # several samples drew: refused
        assert not torch.equal(four["rows"], four["replicated"])


def test_policy_defaults_and_dim0_rule():
    assert Randomness() == Randomness(index="tracked", calls="forward", host="sample")
    assert Randomness(index="dim0").calls == "execution"  # stream v1's first rule, whole
    assert Randomness(index="dim0", calls="forward").calls == "forward"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Randomness().host = "rows"


def test_deprecation_warning_names_the_new_spelling_at_the_caller():
    with pytest.warns(DeprecationWarning) as record:
        knn.keyed(nn.Linear(2, 2), 0, step=0, index="dim0", host_random="forward")
    (warning,) = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert str(warning.message) == ("keyed(..., index='dim0', host_random='forward') is deprecated: use "
                                    "keyed(..., randomness=keyinit.nn.Randomness(index='dim0', host='rows'))")
    assert warning.filename == __file__
    with pytest.warns(DeprecationWarning, match=r"^keyed\(\.\.\., calls='execution'\) is deprecated: use keyed\("
                                                r"\.\.\., randomness=keyinit\.nn\.Randomness\(calls='execution'\)\)$"):
        knn.keyed(nn.Linear(2, 2), 0, step=0, calls="execution")


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match=r"^keyinit\.nn\.Randomness: host must be one of \('sample', 'rows', "
                                         r"'replicated'\), got 'forward' \(the old spelling 'forward' is "
                                         r"host='rows'\)$"):
        Randomness(host="forward")
    with pytest.raises(ValueError, match=r"^keyinit\.nn\.Randomness: index must be one of \('tracked', 'dim0'\), "
                                         r"got 'dim1'$"):
        Randomness(index="dim1")
    with pytest.raises(ValueError, match=r"calls must be one of \('forward', 'execution'\), got 'sample'"):
        Randomness(calls="sample")
    with pytest.raises(TypeError, match=r"^keyed: randomness must be a keyinit\.nn\.Randomness, got str$"):
        knn.keyed(nn.Linear(2, 2), 0, step=0, randomness="dim0")
    with pytest.raises(TypeError, match=r"^keyed: give randomness= or the deprecated index='dim0', not both \(it "
                                        r"is randomness=keyinit\.nn\.Randomness\(index='dim0'\)\)$"):
        knn.keyed(nn.Linear(2, 2), 0, step=0, randomness=Randomness(), index="dim0")
