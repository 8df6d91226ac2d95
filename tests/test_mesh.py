
import pytest

from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape, hybrid_device_array, parse_mesh
from tests.helpers import FakeGPU


@pytest.mark.parametrize("text, shape", [
    ("4x8", MeshShape(4, 8)),
    ("data:4,fsdp:8", MeshShape(4, 8)),
    ("fsdp:8,data:4", MeshShape(4, 8)),
    ("fsdp:8", MeshShape(1, 8)),
    ("32", MeshShape(32, 1)),
    ("-1", MeshShape(-1, 1)),
    ("2x2x2", MeshShape(2, 2, 2)),
    ("data:1,fsdp:4,tensor:8", MeshShape(1, 4, 8)),
    ("tensor:2,expert:4", MeshShape(1, 1, 2, 4)),
    (" 2X4 ", MeshShape(2, 4)),
])
def test_mesh_forms(text, shape):
    assert parse_mesh(text) == shape


@pytest.mark.parametrize("text, words", [
    ("4x", "axis size ''"),
    ("0x8", "axis size '0'"),
    ("axb", "axis size 'a'"),
    ("4x8x2x9x9x2", "has 6 axes"),  # DATAxFSDPxTENSORxEXPERTxSTAGE at most
    ("pipeline:4", "unknown axis 'pipeline'"),
    ("data:4,model:8", "unknown axis 'model'"),
    ("data:4,data:2", "given twice"),
    ("-2", "axis size '-2'"),
])
def test_mesh_errors_name_the_problem(text, words):
    with pytest.raises(UsageError) as err:
        parse_mesh(text)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_axes_and_labels():
    assert MeshShape(4, 8).axis_sizes == {"data": 4, "fsdp": 8}
    assert MeshShape(1, 4, 8).label == "1x4x8"
    assert MeshShape(2, 1, 1, 4).axis_sizes == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}
    assert MeshShape(2, 2, 2, 2).size == 16


def test_minus_one_resolves_to_every_device():
    assert parse_mesh("-1").resolve(32) == MeshShape(32, 1)


def test_fsdp_axis_stays_inside_a_host():
    # 4 hosts x 8 GPUs, listed in a scrambled order as a cluster might report them.
    devices = [FakeGPU(p * 8 + i, p) for i in range(8) for p in (2, 0, 3, 1)]
    array = hybrid_device_array(MeshShape(4, 8), devices)
    assert array.shape == (4, 8)
    for row in array:  # one fsdp group per row: all on one host
        assert len({d.process_index for d in row}) == 1
    assert [row[0].process_index for row in array] == [0, 1, 2, 3]


def test_fsdp_spans_hosts_as_an_in_host_part_times_an_across_host_part():
    """data:2,fsdp:16 on 4 hosts of 8: fsdp is 8 in a host x 2 hosts, data 2 across hosts
    (MaxText's ICI FSDP x DCN FSDP x DCN DP): position (d, f) holds host 2d + f // 8's device
    f % 8, in id order within the host, whatever order the cluster lists them in."""
    devices = [FakeGPU(p * 8 + i, p) for i in range(8) for p in (3, 1, 0, 2)]
    array = hybrid_device_array(MeshShape(2, 16), devices)
    assert [[d.id for d in row] for row in array] == [list(range(16)), list(range(16, 32))]
    assert [[d.process_index for d in row] for row in array] == \
        [[0] * 8 + [1] * 8, [2] * 8 + [3] * 8]


def test_innermost_axes_fill_a_host_first():
    """data:2,fsdp:6 on 3 hosts of 4: fsdp takes gcd(6, 4) = 2 of a host, data the other 2,
    so fsdp is 2 in-host x 3 across and data stays in a host. Exact order checked."""
    from jaxdist.mesh import host_split

    assert host_split([2, 6], 4) == [2, 2]
    assert host_split([2, 128], 8) == [1, 8] and host_split([16, 128], 8) == [1, 8]
    assert host_split([2, 4, 2], 8) == [1, 4, 2]  # stage, data, tensor: stage crosses
    devices = [FakeGPU(p * 4 + i, p) for p in range(3) for i in range(4)]
    array = hybrid_device_array(MeshShape(2, 6), devices)
    assert [[d.id for d in row] for row in array] == [[0, 1, 4, 5, 8, 9],
                                                      [2, 3, 6, 7, 10, 11]]


def test_the_placement_is_mesh_utils_hybrid_mesh():
    """Where the split is contiguous, the array is the one JAX's own
    create_hybrid_device_mesh builds from the same ICI and DCN shapes."""
    from jax.experimental import mesh_utils
    from jaxdist.mesh import host_split

    devices = [FakeGPU(p * 8 + i, p) for p in range(8) for i in range(8)]
    for shape in (MeshShape(2, 32), MeshShape(4, 16), MeshShape(1, 16, 4), MeshShape(8, 8)):
        dims = list(shape.axis_sizes.values())
        ici = host_split(dims, 8)
        ours = hybrid_device_array(shape, devices)
        theirs = mesh_utils.create_hybrid_device_mesh(
            ici, [n // k for n, k in zip(dims, ici)], devices, process_is_granule=True)
        assert [d.id for d in ours.flat] == [d.id for d in theirs.flat], shape


def test_a_mesh_that_cannot_fill_its_hosts_is_one_line():
    from jaxdist.mesh import host_split

    with pytest.raises(UsageError, match=r"mesh 3x4 \(12 devices\) cannot fill hosts of 8 "
                                         r"devices"):
        host_split([3, 4], 8)
