"""DeepEP's events on CPU ranks: every moed call has finished when it returns, so an event is
always complete; the rest of DeepEP's EventOverlap behaviour (hooks run after a wait, the
``release_handle`` flag, ``with event:``) is kept, since client code builds on it."""
from typing import Any, Callable, Optional, Tuple


class EventHandle:
    """DeepEP's captured CUDA event. On CPU it stands for "everything issued so far", which is
    always done."""

    def current_stream_wait(self) -> None:
        """The current stream waits for the event: nothing to wait for on CPU."""


class EventOverlap:
    """DeepEP's EventOverlap (V2 semantics).

    Attributes:
        event: the EventHandle (None once released by ``current_stream_wait(release_handle=True)``).
        extra_tensors: tensors kept alive with the event (DeepEP's record_stream stand-in).
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable[[], None]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Waits for the event (at once on CPU), then runs the hook registered with
        register_hook_after_wait (once); release_handle drops the event."""
        assert self.event is not None, "this EventOverlap has no event (it was released)"
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """A hook to run after the next current_stream_wait() (one at a time, as DeepEP)."""
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):`` releases the event when the block ends."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def completed() -> EventOverlap:
    """The event every moed call returns: complete, with an EventHandle to wait on."""
    return EventOverlap(EventHandle())
