"""The async balancer in front of real (tiny) TCP servers, as a user would put it.

Each server answers one line per connection after a short pause and records how many
requests it is serving at once; the balancer must keep that under `max_inflight`, send every
request somewhere, and keep serving while a server is drained and another one is added.
"""

import asyncio

from offbeat.balancer.aio import AsyncLoadBalancer


class LineServer:
    def __init__(self, name):
        self.name = name
        self.active = 0
        self.peak = 0
        self.served = 0

    async def handle(self, reader, writer):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            line = await reader.readline()
            await asyncio.sleep(0.002)
            writer.write(f"{self.name}:{line.decode().strip()}\n".encode())
            await writer.drain()
            self.served += 1
        finally:
            self.active -= 1
            writer.close()

    async def start(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


async def call(port, payload):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{payload}\n".encode())
    await writer.drain()
    reply = (await reader.readline()).decode().strip()
    writer.close()
    await writer.wait_closed()
    return reply


async def test_balancer_in_front_of_real_servers():
    servers = [LineServer(f"s{i}") for i in range(3)]
    ports = {s.name: await s.start() for s in servers}
    late = LineServer("late")
    late_port = await late.start()
    alb = AsyncLoadBalancer(ports, max_inflight=2)

    async def request(i):
        async with alb.lease(f"r{i}") as lease:
            reply = await call(lease.handle, i)
            assert reply == f"{lease.server_id}:{i}"
            return lease.server_id

    first = [asyncio.create_task(request(i)) for i in range(60)]
    await asyncio.sleep(0.01)
    alb.remove_servers(["s0"], drain=True)  # upgrade s0: its open requests finish
    alb.add_servers({"late": late_port})
    rest = [asyncio.create_task(request(i)) for i in range(60, 120)]
    used = await asyncio.gather(*first, *rest)

    assert len(used) == 120
    assert all(s.peak <= 2 for s in [*servers, late])  # never above max_inflight
    assert sum(s.served for s in [*servers, late]) == 120
    assert late.served > 0 and "s0" not in used[60:]
    status = alb.status()
    assert status["total_inflight"] == 0 and "s0" not in status["servers"]
    for s in [*servers, late]:
        s.server.close()
        await s.server.wait_closed()
