"""A slow link injected into a real launch (the tune="auto" workers): a reduction lands
`seconds` after its launch, so the wait for it (pipe_horovod.engine.wait, where the step
machine blocks) sleeps until then: exposed at K=1, hidden behind the next step's compute
at K=2, as on a real network. Other collectives (the two-stage codecs' own, the
lookahead's prediction exchange) are not slowed: the link is what the measured steps see."""
import time

import pipe_horovod.engine as engine_module


class SlowLink:
    def __init__(self, seconds):
        self.seconds = seconds

    def __enter__(self):
        self.wait, self.engine = engine_module.wait, engine_module.current()
        launch, launched = self.engine.allreduce_async, {}

        def key(handle):                         # Horovod's handles are ints
            return handle if isinstance(handle, int) else id(handle)

        def timed(*args, **kwargs):
            handle = launch(*args, **kwargs)
            launched[key(handle)] = time.perf_counter()
            return handle

        def slow(handle):
            at = launched.pop(key(handle), None)
            if at is not None:
                time.sleep(max(0.0, at + self.seconds - time.perf_counter()))
            return self.wait(handle)
        self.engine.allreduce_async, engine_module.wait = timed, slow
        return self

    def __exit__(self, *exc):
        engine_module.wait = self.wait
        del self.engine.allreduce_async
