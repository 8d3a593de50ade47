/**
 * The demo (`npm run demo`): a small GRPO-like workload through managed
 * mode, and what the cache did for it.
 *
 *   tsx bin/demo.ts [--local] [--workload terminal|sql|rpc] [--tasks N]
 *       [--group N] [--epochs N] [--seed N] [--driver docker|workspace]
 *
 * Against a running stack (`npm start`): TRELLIS_URL and TRELLIS_KEY, or
 * by default the dev stack at http://127.0.0.1:8787 with the trainer key it
 * saved in `.trellis/state/dev-keys.json`. With `--local` it starts its own
 * stack and container host in a temporary directory and stops them after.
 *
 * Default: the terminal-like workload of `bench/workloads.ts`, 2 tasks, a
 * group of 8 rollouts each, 2 epochs, in Docker sandboxes when a host offers
 * them (else workspaces). Every run uses new task names, so it starts from an
 * empty cache. It prints the hit rate, the tool time with and without the
 * cache, the speedup, the coalesced hits and the snapshot bytes.
 */
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import { TrellisClient, TrellisError } from "../client/http.ts";
import type { Driver, HostInfo } from "../core/host-api.ts";
import {
	callCount,
	progress,
	runManaged,
	runTask,
	workload,
	type ManagedCall,
	type WorkloadKind,
} from "../bench/workloads.ts";
import {
	DEFAULT_PERSIST_DIR,
	startLocalHost,
	startLocalStack,
	type LocalHost,
	type LocalStack,
} from "./local-stack.ts";

const USAGE = `usage: tsx bin/demo.ts [--local] [--workload terminal|sql|rpc]
  [--tasks N] [--group N] [--epochs N] [--seed N] [--driver docker|workspace]`;

/** The dev stack's trainer key, saved by `npm start`, if there is one. */
function savedTrainerKey(): string | undefined {
	try {
		const file = path.join(DEFAULT_PERSIST_DIR, "dev-keys.json");
		return (JSON.parse(readFileSync(file, "utf8")) as { trainer?: string })
			.trainer;
	} catch {
		return undefined;
	}
}

/** The drivers of the project's container hosts that are up. */
async function hostDrivers(url: string, key: string): Promise<Set<Driver>> {
	const res = await fetch(`${url}/v1/hosts`, {
		headers: { authorization: `Bearer ${key}` },
		signal: AbortSignal.timeout(10_000),
	});
	if (!res.ok)
		throw new Error(
			`GET /v1/hosts answered ${res.status}: ${(await res.text()).slice(0, 200)}`,
		);
	const { hosts } = (await res.json()) as { hosts: HostInfo[] };
	return new Set(
		hosts.filter((h) => h.status === "up").flatMap((h) => h.drivers),
	);
}

function positive(name: string, v: string | undefined, fallback: number) {
	if (v === undefined) return fallback;
	const n = Number(v);
	if (!Number.isSafeInteger(n) || n < 1)
		throw new Error(`--${name}: give a positive integer\n${USAGE}`);
	return n;
}

const plural = (n: number, word: string) => `${n} ${word}${n === 1 ? "" : "s"}`;
const pct = (x: number) => `${(x * 100).toFixed(1)}%`;
const secs = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
const bytes = (b: number) =>
	b >= 1 << 20
		? `${(b / (1 << 20)).toFixed(1)} MiB`
		: `${(b / 1024).toFixed(1)} KiB`;

/** The figures the demo prints, from the calls as the trainer saw them. */
export function demoFigures(calls: readonly ManagedCall[]) {
	const epochs = [...new Set(calls.map((c) => c.epoch))].sort((a, b) => a - b);
	const per = (pick: (c: ManagedCall) => boolean) =>
		epochs.map((e) => calls.filter((c) => c.epoch === e && pick(c)).length);
	const hits = calls.filter((c) => c.hit).length;
	// Without the cache every call runs: its recorded execution time, which
	// a hit carries too. With it: the server's time per call, replays,
	// sandbox starts and waits on a coalesced execution included.
	const withoutMs = calls.reduce((s, c) => s + c.execMs, 0);
	const withMs = calls.reduce((s, c) => s + c.tookMs, 0);
	return {
		epochs,
		calls: calls.length,
		callsByEpoch: per(() => true),
		hits,
		hitsByEpoch: per((c) => c.hit),
		coalesced: calls.filter((c) => c.coalesced).length,
		hitRate: calls.length === 0 ? 0 : hits / calls.length,
		withoutMs,
		withMs,
		speedup: withMs === 0 ? 0 : withoutMs / withMs,
	};
}

/**
 * Runs the demo with command-line arguments `argv` (without the command).
 * `trellis demo` and `tsx bin/demo.ts` both come here.
 */
export async function runDemo(argv: string[]): Promise<void> {
	const { values } = parseArgs({
		args: argv,
		options: {
			local: { type: "boolean", default: false },
			workload: { type: "string", default: "terminal" },
			tasks: { type: "string" },
			group: { type: "string" },
			epochs: { type: "string" },
			seed: { type: "string" },
			driver: { type: "string" },
			help: { type: "boolean", short: "h" },
		},
	});
	if (values.help) {
		console.log(USAGE);
		return;
	}
	const kind = values.workload as WorkloadKind;
	if (!["terminal", "sql", "rpc"].includes(kind))
		throw new Error(`--workload: unknown workload ${kind}\n${USAGE}`);
	if (values.driver && !["docker", "workspace"].includes(values.driver))
		throw new Error(`--driver: docker or workspace\n${USAGE}`);

	let stack: LocalStack | null = null;
	let local: LocalHost | null = null;
	let persist: string | null = null;
	try {
		let url: string;
		let key: string;
		if (values.local) {
			persist = mkdtempSync(path.join(tmpdir(), "trellis-demo-"));
			process.stderr.write("Starting a local stack and host (--local)...\n");
			stack = await startLocalStack({ persistTo: persist });
			local = await startLocalHost({ worker: stack.url, key: stack.hostKey });
			url = stack.url;
			key = stack.trainerKey;
		} else {
			url = process.env.TRELLIS_URL ?? "http://127.0.0.1:8787";
			const k = process.env.TRELLIS_KEY ?? savedTrainerKey();
			if (!k)
				throw new Error(
					"no key: start the stack with `npm start` (it saves one), set TRELLIS_KEY, or run with --local",
				);
			key = k;
		}

		let drivers: Set<Driver>;
		try {
			drivers = await hostDrivers(url, key);
		} catch (err) {
			throw new Error(
				`cannot reach Trellis at ${url} (${(err as Error).message}): start it with \`npm start\`, or run the demo with --local`,
			);
		}
		const driver =
			(values.driver as "docker" | "workspace" | undefined) ??
			(drivers.has("docker") ? "docker" : "workspace");
		const w = workload(kind, {
			seed: positive("seed", values.seed, 1),
			tasks: positive("tasks", values.tasks, 2),
			group: positive("group", values.group, 8),
			epochs: positive("epochs", values.epochs, 2),
			driver,
		});
		if (!drivers.has(w.template.driver))
			throw new Error(
				`no container host offers ${w.template.driver} sandboxes at ${url}: \`npm start\` starts one, or run with --local`,
			);

		const size = {
			tasks: new Set(w.groups.map((g) => g.task)).size,
			group: w.groups[0]?.rollouts.length ?? 0,
			epochs: new Set(w.groups.map((g) => g.epoch)).size,
		};
		console.log(`Trellis demo: ${w.title}
  ${plural(size.tasks, "task")} × a group of ${plural(size.group, "rollout")} × ${plural(size.epochs, "epoch")}, ${callCount(w)} tool calls
  (stand-in: ${w.standIns})
`);
		const prefix = `demo-${randomBytes(4).toString("hex")}`;
		const bar = progress(callCount(w));
		const client = new TrellisClient({ url, key });
		const calls = await runManaged(client, w, {
			prefix,
			onCall: () => bar.tick(),
			onGroup: (g) => bar.label(`(${g.task}, epoch ${g.epoch})`),
		});
		bar.end();

		const tasks = [...new Set(w.groups.map((g) => runTask(prefix, g.task)))];
		let snapshots = 0;
		let snapshotBytes = 0;
		for (const task of tasks) {
			const s = await client.stats(task);
			snapshots += s.snapshots;
			snapshotBytes += s.snapshotBytes;
		}

		const f = demoFigures(calls);
		const byEpoch = (xs: number[], fmt: (x: number) => string = String) =>
			f.epochs.map((e, i) => `epoch ${e}: ${fmt(xs[i])}`).join(", ");
		const rates = f.epochs.map(
			(_, i) => f.hitsByEpoch[i] / Math.max(1, f.callsByEpoch[i]),
		);
		console.log(`
calls              ${f.calls} (${byEpoch(f.callsByEpoch)})
hits               ${f.hits} (${byEpoch(f.hitsByEpoch)})
hit rate           ${pct(f.hitRate)} (${byEpoch(rates, pct)})
coalesced hits     ${f.coalesced} (identical calls of a group, run once while the others waited)
tool time without  ${secs(f.withoutMs)} (every call executed: the recorded execution times)
tool time with     ${secs(f.withMs)} (the server's time per call, replays and starts included)
speedup            ${f.speedup.toFixed(2)}×
snapshots          ${snapshots} (${bytes(snapshotBytes)})`);
		if (!values.local)
			console.log(`
The tasks were ${tasks.join(", ")}; look closer with
  npx tsx bin/trellis.ts stats ${tasks[0]}    (TRELLIS_KEY set to the trainer key)`);
	} finally {
		await local?.host.stop();
		await stack?.stop();
		if (persist) rmSync(persist, { recursive: true, force: true });
	}
}

// Run directly (`tsx bin/demo.ts`), not when imported by the CLI.
if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
	runDemo(process.argv.slice(2)).catch((err: unknown) => {
		console.error(
			err instanceof TrellisError
				? `${err.code} (${err.status}): ${err.message}`
				: err instanceof Error
					? err.message
					: err,
		);
		process.exitCode = 1;
	});
}
