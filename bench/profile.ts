/**
 * A CPU profile of the Worker as `wrangler dev` runs it: connects to
 * wrangler's DevTools inspector, samples the Worker's isolate (its Durable
 * Objects included) for a while, writes a `.cpuprofile` that Chrome DevTools
 * or speedscope open, and prints where the time went, by function: self time
 * and inclusive time, as shares of the samples that were not idle.
 *
 *   npm start                                  # prints the inspector port
 *   npx tsx bench/profile.ts --port 9229 --seconds 15 --out worker.cpuprofile
 *
 * Put load on the Worker meanwhile, e.g. `npm run bench -- --url URL --key KEY`.
 * Sampling slows the Worker down: latencies measured during a profile are
 * not benchmark figures.
 *
 * Flags: --port N (required) --seconds 10 --interval 100 (µs between samples)
 *        --out FILE (default worker.cpuprofile) --top 40
 */
import { writeFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { WebSocket } from "undici";

const { values: flags } = parseArgs({
	options: {
		port: { type: "string" },
		seconds: { type: "string", default: "10" },
		interval: { type: "string", default: "100" },
		out: { type: "string", default: "worker.cpuprofile" },
		top: { type: "string", default: "40" },
	},
});
const positive = (name: string, v: string | undefined): number => {
	const n = Number(v);
	if (!Number.isFinite(n) || n <= 0) throw new Error(`--${name}: ${v}?`);
	return n;
};
const port = positive("port", flags.port);
const seconds = positive("seconds", flags.seconds);
const interval = positive("interval", flags.interval);
const top = Math.floor(positive("top", flags.top));

/** The Chrome DevTools protocol's profile (Profiler.stop's result). */
interface Profile {
	nodes: {
		id: number;
		callFrame: { functionName: string; url: string; lineNumber: number };
		children?: number[];
	}[];
	samples: number[];
}

/** Sends DevTools protocol commands over one socket, one answer each. */
async function inspector(url: string) {
	// wrangler's inspector refuses a socket whose Origin is not local.
	const ws = new WebSocket(url, { headers: { origin: "http://localhost" } });
	type Answer = { result?: unknown; error?: unknown };
	const waiting = new Map<number, (m: Answer) => void>();
	let next = 0;
	ws.binaryType = "arraybuffer";
	const decoder = new TextDecoder();
	ws.addEventListener("message", (e) => {
		const text =
			typeof e.data === "string"
				? e.data
				: decoder.decode(e.data as ArrayBuffer);
		const m = JSON.parse(text);
		if (typeof m.id === "number" && waiting.has(m.id)) {
			waiting.get(m.id)!(m);
			waiting.delete(m.id);
		}
	});
	await new Promise<void>((resolve, reject) => {
		ws.addEventListener("open", () => resolve(), { once: true });
		ws.addEventListener(
			"error",
			() => reject(new Error(`the inspector at ${url} refused the socket`)),
			{ once: true },
		);
	});
	return {
		async send<T>(method: string, params: object = {}): Promise<T> {
			const id = ++next;
			const answer = new Promise<Answer>((r) => waiting.set(id, r));
			ws.send(JSON.stringify({ id, method, params }));
			const m = await answer;
			if (m.error) throw new Error(`${method}: ${JSON.stringify(m.error)}`);
			return m.result as T;
		},
		close: () => ws.close(),
	};
}

/** Self and inclusive sample counts per function, and the non-idle total. */
function tally(p: Profile) {
	const byId = new Map(p.nodes.map((n) => [n.id, n]));
	const parent = new Map<number, number>();
	for (const n of p.nodes)
		for (const c of n.children ?? []) parent.set(c, n.id);
	const name = (id: number) => {
		const f = byId.get(id)!.callFrame;
		const file = f.url.split("/").pop() || "(native)";
		return `${f.functionName || "(anonymous)"} ${file}:${f.lineNumber + 1}`;
	};
	const perNode = new Map<number, number>();
	for (const s of p.samples) perNode.set(s, (perNode.get(s) ?? 0) + 1);
	const self = new Map<string, number>();
	const inclusive = new Map<string, number>();
	let busy = 0;
	for (const [id, n] of perNode) {
		if (byId.get(id)!.callFrame.functionName === "(idle)") continue;
		busy += n;
		self.set(name(id), (self.get(name(id)) ?? 0) + n);
		const seen = new Set<string>();
		for (
			let at: number | undefined = id;
			at !== undefined;
			at = parent.get(at)
		) {
			const k = name(at);
			if (seen.has(k)) continue; // recursion counts once
			seen.add(k);
			inclusive.set(k, (inclusive.get(k) ?? 0) + n);
		}
	}
	return { self, inclusive, busy, total: p.samples.length };
}

function print(title: string, counts: Map<string, number>, busy: number) {
	console.log(`\n${title}`);
	const rows = [...counts].sort((a, b) => b[1] - a[1]).slice(0, top);
	for (const [k, n] of rows)
		console.log(`${((100 * n) / busy).toFixed(1).padStart(6)}%  ${k}`);
}

const list = (await (await fetch(`http://127.0.0.1:${port}/json`)).json()) as {
	webSocketDebuggerUrl: string;
}[];
if (list.length === 0) throw new Error(`no inspector target on port ${port}`);
const session = await inspector(list[0].webSocketDebuggerUrl);
await session.send("Profiler.enable");
await session.send("Profiler.setSamplingInterval", { interval });
await session.send("Profiler.start");
for (let s = 1; s <= seconds; s++) {
	await new Promise((r) => setTimeout(r, 1000));
	process.stderr.write(`\rprofiling: ${s}/${seconds} s`);
}
process.stderr.write("\n");
const { profile } = await session.send<{ profile: Profile }>("Profiler.stop");
session.close();
writeFileSync(flags.out!, JSON.stringify(profile));
const t = tally(profile);
console.log(
	`${t.total} samples, ${t.busy} not idle (${((100 * t.busy) / Math.max(1, t.total)).toFixed(0)}%); wrote ${flags.out}`,
);
print("self time (share of non-idle samples)", t.self, t.busy);
print("inclusive time", t.inclusive, t.busy);
