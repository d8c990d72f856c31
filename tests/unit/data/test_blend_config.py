"""megatron.data.blend_config: the one parser of --data-path blends and --split (Megatron-Core's
get_blend_from_list / parse_and_normalize_split rules, stricter where Megatron reads garbage)."""
import numpy as np
import pytest

from megatron.data.blend_config import Blend, get_blend_from_list, parse_split, split_matrix, split_sources


def test_blends_as_megatron_reads_them():
    assert get_blend_from_list(["a"]) == Blend("--data-path", ("a",), None)
    # Several prefixes without weights stay unweighted (Megatron's weights=None), not an error.
    assert get_blend_from_list(["a", " b"]) == Blend("--data-path", ("a", "b"), None)
    blend = get_blend_from_list(["0.2", "a", "0.8", "b"], "--train-data-path")
    assert blend.flag == "--train-data-path" and blend.prefixes == ("a", "b")
    assert blend.weights == pytest.approx((0.2, 0.8))
    assert get_blend_from_list(["3", "a", "7", "b"]).weights == tuple(np.array([3, 7]) / 10.0)
    assert get_blend_from_list(["1e2", "a", "1", "b"]).weights == pytest.approx((100 / 101, 1 / 101))


@pytest.mark.parametrize("entries, match", [
    ([], r"no dataset given"),
    (["0.3", "a", "0.7"], r"'0.3' reads as a weight, but the list is not pairs WEIGHT PREFIX"),
    (["0.3", "a", "b"], r"'0.3' reads as a weight"),
    (["a", "0.3"], r"'0.3' reads as a weight"),
    (["0.3", "1", "0.7", "b"], r"'1' stands where a dataset prefix belongs"),
    (["0.3", "a", "0", "b"], r"weight 0 of b must be a finite positive number"),
    (["0.3", "a", "-1", "b"], r"weight -1 of b must be a finite positive number"),
    (["0.3", "a", "nan", "b"], r"weight nan of b must be a finite positive number"),
    (["inf", "a", "1", "b"], r"weight inf of a must be a finite positive number"),
    (["1e308", "a", "1e308", "b"], r"the weights overflow"),
])
def test_malformed_blends_name_the_flag_and_value(entries, match):
    shown = " ".join(entries)
    with pytest.raises(ValueError, match=rf"^--valid-data-path \({shown}\): {match}"):
        get_blend_from_list(entries, "--valid-data-path")


def test_split_parsing():
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("90/5/5") == pytest.approx([0.9, 0.05, 0.05])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    # Megatron's regex reads "1e2,1" as 1,2,1 (a 25/50/25 split); here it is 100:1.
    assert parse_split("1e2,1") == pytest.approx([100 / 101, 1 / 101, 0.0])
    assert split_matrix(parse_split("98,2,0")) == [(0.0, 0.98), (0.98, 1.0), None]


@pytest.mark.parametrize("split, match", [
    ("nan,1,1", "finite"), ("inf,1", "finite"), ("1,-1", "finite number >= 0"), ("90,x", "up to three numbers"),
    ("", "up to three numbers"), ("1,,1", "up to three numbers"), ("1,1,1,1", "up to three numbers"),
    ("0,0,0", "sum to 0"),
])
def test_bad_splits_name_the_flag_and_value(split, match):
    with pytest.raises(ValueError, match=rf"^--split \({split}\): .*{match}"):
        parse_split(split)


def test_split_sources():
    sources = split_sources(data_path=["0.5", "a", "0.5", "b"], split="98,2,0")
    assert [s.split if s else None for s in sources] == ["train", "valid", None]
    assert sources[1].bookends == pytest.approx((0.98, 1.0))
    assert sources[1].flags == "--data-path (0.5 a 0.5 b) with --split 98,2,0"
    per = split_sources(data_path=None, split="ignored", train_data_path=["2", "a"],
                        valid_data_path=["0.3", "b", "0.7", "c"])
    # Megatron-Core: one prefix per split is a plain dataset, its weight ignored.
    assert per[0].blend.weights is None and per[0].bookends == (0.0, 1.0)
    assert per[1].blend.weights == pytest.approx((0.3, 0.7)) and per[2] is None
    assert per[1].flags == "--valid-data-path (0.3 b 0.7 c)"
    with pytest.raises(ValueError, match="mutually exclusive"):
        split_sources(data_path=["a"], split="1", train_data_path=["b"])
    with pytest.raises(ValueError, match="no training data"):
        split_sources(data_path=None, split="1", valid_data_path=["b"])
