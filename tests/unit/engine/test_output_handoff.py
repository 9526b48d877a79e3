"""``server.Handoff``: outputs put by the engine's loop thread reach their requests' queues
on the event loop, each queue's in order, a step's outputs with one wake-up between them."""

from __future__ import annotations

import asyncio
import threading

from pdserve.engine.server import Handoff

NUM_REQUESTS, NUM_STEPS = 32, 200


def test_a_steps_outputs_cross_together_and_each_queue_keeps_its_order():
    async def main():
        loop = asyncio.get_running_loop()
        wakes = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args):
            nonlocal wakes
            wakes += 1
            return call_soon_threadsafe(callback, *args)

        loop.call_soon_threadsafe = counted
        handoff = Handoff(loop)
        queues = [asyncio.Queue() for _ in range(NUM_REQUESTS)]

        def engine_thread():  # one put per running request per step, as EngineLoop._deliver
            for step in range(NUM_STEPS):
                for q in queues:
                    handoff.put(q, step)

        async def read(q):
            return [await q.get() for _ in range(NUM_STEPS)]

        readers = [asyncio.ensure_future(read(q)) for q in queues]
        thread = threading.Thread(target=engine_thread)
        thread.start()
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        thread.join()
        return got, wakes

    got, wakes = asyncio.run(main())
    assert all(outputs == list(range(NUM_STEPS)) for outputs in got)
    # Without batching there would be one wake-up per output (6,400).
    assert 1 <= wakes < NUM_REQUESTS * NUM_STEPS / 4


def test_an_output_put_while_a_drain_runs_is_not_stranded():
    async def main():
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        q: asyncio.Queue = asyncio.Queue()
        for round_ in range(500):  # the thread's put races the loop's drain every round
            thread = threading.Thread(target=handoff.put, args=(q, round_))
            thread.start()
            assert await asyncio.wait_for(q.get(), 5) == round_
            thread.join()

    asyncio.run(main())


def test_a_closed_event_loop_drops_the_output_quietly():
    loop = asyncio.new_event_loop()
    handoff = Handoff(loop)
    loop.close()
    handoff.put(asyncio.Queue(), "late")  # no RuntimeError out of the engine's thread
