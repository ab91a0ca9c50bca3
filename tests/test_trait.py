"""The ModelDeviceFeed ABC keeps the engine trait's defaults, value for value."""

import pytest

import metrale_feed
from metrale_feed import ModelDeviceFeed, NoDeviceTokenFeed
from metrale_feed.kv import SequenceState

ERROR_DEFAULTS = {
    "decode_batch_fed": ([], [], 0),
    "argmax_batch_to_feed": (0, [], 0, 0, 0),
    "sample_batch_to_feed": (0, None, [], 0, 0, 0),
    "reserve_decode_block": (SequenceState(0),),
    "release_decode_blocks": (SequenceState(0), 1),
    "copy_d2h_async": (0, bytearray(4), 0),
    "alloc_host_pinned": (64,),
    "free_host_pinned": (0, 64),
    "create_event": (),
}


class Bare(ModelDeviceFeed):
    """A model that implements nothing: every method is the trait's default."""


def test_is_an_abc_that_a_bare_model_can_instantiate():
    import abc

    assert isinstance(ModelDeviceFeed, abc.ABCMeta)
    Bare()


@pytest.mark.parametrize("method", sorted(ERROR_DEFAULTS))
def test_error_defaults_raise_no_device_token_feed_with_the_exact_message(method):
    with pytest.raises(NoDeviceTokenFeed) as info:
        getattr(Bare(), method)(*ERROR_DEFAULTS[method])
    assert str(info.value) == f"{method}: this model has no device token feed"
    assert isinstance(info.value, metrale_feed.FeedError)
    assert isinstance(info.value, NotImplementedError)


def test_value_and_no_op_defaults():
    model = Bare()
    assert model.supports_device_token_feed() is False
    assert model.event_query(12345) is True
    assert model.event_synchronize(12345) is None
    assert model.destroy_event(12345) is None
    assert model.fed_step_settled() is None


def test_every_trait_method_is_covered():
    trait = {name for name in vars(ModelDeviceFeed) if not name.startswith("_")}
    covered = set(ERROR_DEFAULTS) | {"supports_device_token_feed", "event_query",
                                     "event_synchronize", "destroy_event", "fed_step_settled"}
    assert trait == covered


def test_router_refuses_a_model_without_the_feed():
    with pytest.raises(metrale_feed.FeedError, match="supports_device_token_feed"):
        metrale_feed.AsyncDeviceIo(Bare(), 8)


def test_runtime_mixin_implements_the_runtime_half(host, no_leaks):
    from metrale_feed.runtime import RuntimeFeedMixin

    class Model(RuntimeFeedMixin, ModelDeviceFeed):
        def __init__(self):
            self.init_device_feed(vocab=10, max_rows=4)

    model = Model()
    assert model.supports_device_token_feed() is True
    event = model.create_event()
    ptr = model.alloc_host_pinned(16)
    assert metrale_feed.read_pinned_u32(ptr, 4) == [0, 0, 0, 0]  # zeroed
    import numpy as np

    logits = np.zeros((2, 10), np.float32)
    logits[0, 7] = 1.0
    logits[1, 3] = 2.0
    dev = metrale_feed.DeviceBuffer(logits.nbytes)
    metrale_feed.copy_h2d_async(dev, logits.view(np.uint8).reshape(-1), 0)
    model.argmax_batch_to_feed(dev, [(metrale_feed.NO_TOKEN,) * 2, (3, metrale_feed.NO_TOKEN)], ptr, event, 0)
    model.event_synchronize(event)
    assert model.event_query(event) is True
    ids = metrale_feed.read_pinned_u32(ptr, 2)
    expected = metrale_feed.reference_argmax(logits, [(0xFFFFFFFF, 0xFFFFFFFF), (3, 0xFFFFFFFF)])
    assert ids == list(expected) and ids[0] == 7
    assert model.feed_prev_rows == 2
    out = bytearray(8)
    model.copy_d2h_async(model.feed_cells, out, 0)
    metrale_feed.stream_synchronize(0)
    assert list(memoryview(out).cast("I")) == ids
    model.destroy_event(event)
    model.free_host_pinned(ptr, 16)
    dev.close()
    model.close_device_feed()


def test_device_token_feed_is_the_traits_methods_written_once():
    """``contract.DeviceTokenFeed`` is read from the trait: the methods written in trait.py's
    ``ModelDeviceFeed`` (read here from the source), no more, no fewer; a duck-typed model with
    all of them passes, one without any of them is refused naming it."""
    import ast
    import pathlib

    from metrale_feed import contract, trait

    tree = ast.parse(pathlib.Path(trait.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelDeviceFeed")
    written = sorted(f.name for f in cls.body if isinstance(f, ast.FunctionDef)
                     and not f.name.startswith("_"))
    assert len(written) >= 14 and "copy_d2h_async" in written
    assert list(contract._methods(contract.DeviceTokenFeed)) == written

    class Duck:
        pass

    for name in written:
        setattr(Duck, name, lambda self, *a, **k: None)
    assert isinstance(Duck(), contract.DeviceTokenFeed)
    for gone in (written[0], written[-1]):
        partial = type("Partial", (), {n: getattr(Duck, n) for n in written if n != gone})
        assert not isinstance(partial(), contract.DeviceTokenFeed)
        with pytest.raises(TypeError, match=rf"needs a model with {gone}\(\) \(DeviceTokenFeed\)"):
            contract.require(partial(), "a test", contract.DeviceTokenFeed)
