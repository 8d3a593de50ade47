/**
 * Self-check of the load generator against a tiny Node HTTP server in a child
 * process (a separate process, so that a server stall does not also stall the
 * generator's event loop, which would hide the very thing being checked).
 *
 *   npx tsx bench/loadgen-check.ts
 *
 * Exits non-zero if any check fails. Each check names what it guards.
 */
import { spawn } from "node:child_process";
import { once } from "node:events";
import { ms, runLoad, stallsOf, type LoadResult } from "./loadgen.ts";

// GET /ok: 200 at once. /slow?ms=N: 200 after N ms (a timer, not busy).
// /stall?ms=N: blocks the server's event loop for N ms once, then 200.
// /500: a 500. /never: no answer at all. /body?s=TEXT: echoes TEXT.
const SERVER = `
const http = require("node:http");
const server = http.createServer((req, res) => {
	const u = new URL(req.url, "http://x");
	const n = Number(u.searchParams.get("ms") ?? 0);
	if (u.pathname === "/never") return;
	if (u.pathname === "/500") { res.statusCode = 500; return res.end("no"); }
	if (u.pathname === "/slow") return setTimeout(() => res.end("ok"), n);
	if (u.pathname === "/stall") {
		const until = Date.now() + n;
		while (Date.now() < until) {}
		return res.end("ok");
	}
	if (u.pathname === "/body") return res.end(u.searchParams.get("s") ?? "");
	res.end("ok");
});
server.keepAliveTimeout = 60000;
server.listen(0, "127.0.0.1", () => console.log(server.address().port));
`;

async function startServer(): Promise<{ origin: string; stop(): void }> {
	const child = spawn(process.execPath, ["-e", SERVER], {
		stdio: ["ignore", "pipe", "inherit"],
	});
	const [chunk] = (await Promise.race([
		once(child.stdout!, "data"),
		new Promise((_, reject) =>
			setTimeout(() => reject(new Error("server did not start")), 10_000),
		),
	])) as [Buffer];
	const port = Number(chunk.toString().trim());
	return {
		origin: `http://127.0.0.1:${port}`,
		stop: () => child.kill(),
	};
}

let failures = 0;
function expect(name: string, cond: boolean, r: LoadResult): void {
	const line =
		`${cond ? "ok  " : "FAIL"} ${name}: achieved ${r.achievedRate.toFixed(0)}` +
		`/${r.targetRate} p50 ${ms(r.latencyUs.p50)} p99 ${ms(r.latencyUs.p99)}` +
		` max ${ms(r.latencyUs.max)} ms, errors ${JSON.stringify(r.errorKinds)}` +
		`, late sends ${r.lateSends}`;
	console.log(line);
	if (!cond) failures++;
}

const server = await startServer();
const base = { origin: server.origin, progress: false as const };
try {
	// The schedule is kept: a fast server sees the target rate, no errors.
	let r = await runLoad({
		...base,
		name: "steady",
		rate: 1000,
		durationMs: 3000,
		warmupMs: 500,
		request: () => ({ method: "GET", path: "/ok" }),
	});
	expect(
		"steady 1000/s is kept with no errors",
		Math.abs(r.achievedRate - 1000) < 50 &&
			r.errors === 0 &&
			r.ok === 3000 &&
			r.latencyUs.p50 < 5000,
		r,
	);

	// Latency is measured: a 20 ms handler shows a p50 just above 20 ms.
	r = await runLoad({
		...base,
		name: "slow",
		rate: 200,
		durationMs: 2000,
		warmupMs: 200,
		request: () => ({ method: "GET", path: "/slow?ms=20" }),
	});
	expect(
		"a 20 ms handler reads as 20-30 ms at p50",
		r.latencyUs.p50 >= 20_000 && r.latencyUs.p50 < 30_000 && r.errors === 0,
		r,
	);

	// Coordinated omission: the server freezes for 500 ms once. A closed-loop
	// generator would see one slow request per connection and a clean p99;
	// open loop charges the frozen period to every request scheduled in it
	// (~500 of 3000 here), so p99 must be in the hundreds of ms.
	let stalled = false;
	r = await runLoad({
		...base,
		name: "stall",
		rate: 1000,
		durationMs: 3000,
		warmupMs: 200,
		request: (i) => {
			if (i === 1500 && !stalled) {
				stalled = true;
				return { method: "GET", path: "/stall?ms=500" };
			}
			return { method: "GET", path: "/ok" };
		},
	});
	expect(
		"a 500 ms server stall shows in p99 (no coordinated omission)",
		r.latencyUs.p99 > 300_000 &&
			r.latencyUs.p50 < 50_000 &&
			r.latencyUs.max >= 450_000,
		r,
	);
	const stalls = stallsOf(r.timelineMaxMs);
	expect(
		"a 500 ms server stall reads as one stall of the timeline, peaking near 500 ms",
		stalls.length === 1 &&
			stalls[0].peakMs >= 450 &&
			stalls[0].peakMs < 700 &&
			Math.abs(stalls[0].atS - 1.3) < 0.3,
		r,
	);

	// Errors are counted by kind: non-2xx, a failed body check.
	r = await runLoad({
		...base,
		name: "errors",
		rate: 500,
		durationMs: 1000,
		request: (i) =>
			i % 10 === 0
				? { method: "GET", path: "/500" }
				: {
						method: "GET",
						path: `/body?s=${i % 10 === 1 ? "miss" : "hit"}`,
						check: (b) => (b === "hit" ? null : `got ${b}`),
					},
	});
	expect(
		"non-2xx and failed checks are errors, the rest ok",
		r.errorKinds.status === 50 && r.errorKinds.check === 50 && r.ok === 400,
		r,
	);

	// Bounded: requests that never answer are aborted after the drain and
	// counted as unfinished; over the in-flight cap they are dropped.
	const t = Date.now();
	r = await runLoad({
		...base,
		name: "never",
		rate: 200,
		durationMs: 1000,
		drainMs: 500,
		maxInFlight: 150,
		request: () => ({ method: "GET", path: "/never" }),
	});
	expect(
		"silent server: 150 unfinished, 50 dropped, run ends in bounded time",
		r.errorKinds.unfinished === 150 &&
			r.errorKinds.dropped === 50 &&
			r.ok === 0 &&
			Date.now() - t < 4000,
		r,
	);
} finally {
	server.stop();
}
if (failures > 0) {
	console.error(`${failures} check(s) failed`);
	process.exit(1);
}
console.log("all load generator checks passed");
