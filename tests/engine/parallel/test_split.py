import pytest
from multilane.engine.parallel import chunk_sizes


@pytest.mark.parametrize("batch,lanes", [(10, 1), (10, 3), (7, 4), (3, 4), (0, 2), (1, 8), (64, 2)])
def test_even_split_differs_by_at_most_one_and_adds_up(batch, lanes):
    sizes = chunk_sizes(batch, lanes)
    assert len(sizes) == lanes and sum(sizes) == batch
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_weights_give_a_proportional_uneven_split():
    assert chunk_sizes(30, 2, [2, 1]) == [20, 10]
    assert chunk_sizes(10, 3, [1, 1, 1]) == [4, 3, 3]
    assert sum(chunk_sizes(1001, 4, [0.1, 0.2, 0.3, 0.4])) == 1001
    assert chunk_sizes(5, 2, [1, 0]) == [5, 0]


def test_bad_weights_are_refused():
    with pytest.raises(ValueError):
        chunk_sizes(10, 2, [1])
    with pytest.raises(ValueError):
        chunk_sizes(10, 2, [0, 0])
