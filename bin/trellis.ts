/**
 * The `trellis` command line.
 *
 *   trellis dev [--port N] [--persist-to DIR] [--verbose] [--no-host]
 *       a local stack (wrangler dev + D1 + R2 + Durable Objects) and a
 *       container host beside it, until Ctrl-C
 *   trellis demo [--local] [...]             a GRPO-like demo (bin/demo.ts)
 *   trellis stats <task>                     a task's counters, as JSON
 *   trellis keys create --role R [--project P] [--name N]
 *
 * `stats` and `keys` talk to TRELLIS_URL (default http://127.0.0.1:8787)
 * with TRELLIS_KEY; `keys create` falls back to the local stack's admin key
 * in `.dev.vars`.
 */
import { readFileSync } from "node:fs";
import { createServer } from "node:net";
import path from "node:path";
import { parseArgs } from "node:util";
import { TrellisClient, TrellisError } from "../client/http.ts";
import { Role } from "../core/api.ts";
import { runDemo } from "./demo.ts";
import {
	REPO_ROOT,
	startLocalHost,
	startLocalStack,
	type LocalHost,
} from "./local-stack.ts";

const USAGE = `usage:
  trellis dev [--port N] [--persist-to DIR] [--verbose] [--no-host]
  trellis demo [--local] [--workload terminal|sql|rpc] [--tasks N] [--group N] [--epochs N]
  trellis stats <task>
  trellis keys create --role trainer|host|admin [--project P] [--name N]`;

/** Whether a loopback port is free, so `dev` can keep wrangler's usual 8787. */
function portFree(port: number): Promise<boolean> {
	return new Promise((resolve) => {
		const server = createServer();
		server.once("error", () => resolve(false));
		server.listen(port, "127.0.0.1", () => server.close(() => resolve(true)));
	});
}

async function dev(argv: string[]): Promise<void> {
	const { values } = parseArgs({
		args: argv,
		options: {
			port: { type: "string" },
			"persist-to": { type: "string" },
			verbose: { type: "boolean", default: false },
			"no-host": { type: "boolean", default: false },
		},
	});
	const port = values.port
		? Number(values.port)
		: (await portFree(8787))
			? 8787
			: undefined;
	// Listen before starting: Ctrl-C during the start must still stop the
	// stack (wrangler runs in its own process group and does not see it).
	// The handlers stay installed while stopping: a terminal's Ctrl-C can
	// arrive twice (to the group, and relayed by tsx's parent process), and
	// with no handler left the second would kill us before the stack stops.
	// A third signal gives up on stopping cleanly.
	let signals = 0;
	const interrupted = new Promise<void>((resolve) => {
		const onSignal = () => {
			signals++;
			if (signals >= 3) process.exit(130);
			resolve();
		};
		process.on("SIGINT", onSignal);
		process.on("SIGTERM", onSignal);
	});
	console.log("Starting the local stack (wrangler dev)...");
	const stack = await startLocalStack({
		port,
		persistTo: values["persist-to"],
		quiet: !values.verbose,
	});
	let local: LocalHost | null = null;
	if (!values["no-host"]) {
		try {
			// Managed rollouts need a host: one on loopback, registered with
			// the dev project's host key, like `tsx bin/host.ts` would.
			local = await startLocalHost({
				worker: stack.url,
				key: stack.hostKey,
				name: "local",
				log: (m) => process.stderr.write(`[host] ${m}\n`),
			});
		} catch (err) {
			await stack.stop();
			throw err;
		}
	}
	const body = JSON.stringify({
		call: { tool: "bash", args: { cmd: "ls" } },
		history: [],
	});
	console.log(`
Trellis is running at ${stack.url}
  project      ${stack.project}
  state        ${path.relative(process.cwd(), stack.persistTo) || "."}
  inspector    ws://127.0.0.1:${stack.inspectorPort}/ws  (npx tsx bench/profile.ts --port ${stack.inspectorPort})

export TRELLIS_URL=${stack.url}
export TRELLIS_KEY=${stack.trainerKey}
export TRELLIS_HOST_KEY=${stack.hostKey}
${hostLines(local)}
Try it:
  curl -s -X POST "$TRELLIS_URL/v1/tasks/demo/lookup" \\
    -H "authorization: Bearer $TRELLIS_KEY" \\
    -H "content-type: application/json" \\
    -d '${body}'

Run the demo (a GRPO-like workload through the cache) in another terminal:
  npm run demo

Press Ctrl-C to stop.`);
	await interrupted;
	console.log("\nStopping...");
	// The host first: it deregisters from the Worker on its way out.
	await local?.host.stop();
	await stack.stop();
}

/** What the dev command says about its container host. */
function hostLines(local: LocalHost | null): string {
	if (!local)
		return "\nNo container host (--no-host): managed rollouts will get 503 no_host.\n";
	const docker = local.dockerMissing
		? `\n  docker       not offered: ${local.dockerMissing}`
		: "";
	return `
A container host runs beside it at ${local.url}
  drivers      ${local.drivers.join(", ")}${docker}
`;
}

function envClient(fallbackKey?: () => string | undefined): TrellisClient {
	const url = process.env.TRELLIS_URL ?? "http://127.0.0.1:8787";
	const key = process.env.TRELLIS_KEY ?? fallbackKey?.();
	if (!key) throw new Error("set TRELLIS_KEY to an API key");
	return new TrellisClient({ url, key });
}

function devVarsAdminKey(): string | undefined {
	try {
		const text = readFileSync(path.join(REPO_ROOT, ".dev.vars"), "utf8");
		return /^\s*TRELLIS_ADMIN_KEY\s*=\s*"?([^"\n]+)"?\s*$/m.exec(text)?.[1];
	} catch {
		return undefined;
	}
}

async function stats(argv: string[]): Promise<void> {
	const { positionals } = parseArgs({ args: argv, allowPositionals: true });
	const task = positionals[0];
	if (!task) throw new Error(USAGE);
	console.log(JSON.stringify(await envClient().stats(task), null, 2));
}

async function keys(argv: string[]): Promise<void> {
	const { positionals, values } = parseArgs({
		args: argv,
		allowPositionals: true,
		options: {
			role: { type: "string" },
			project: { type: "string" },
			name: { type: "string" },
		},
	});
	if (positionals[0] !== "create") throw new Error(USAGE);
	const role = Role.parse(values.role);
	const created = await envClient(devVarsAdminKey).createKey({
		role,
		project: values.project ?? (process.env.TRELLIS_KEY ? undefined : "dev"),
		name: values.name,
	});
	console.log(JSON.stringify(created, null, 2));
}

async function main(): Promise<void> {
	const [command, ...rest] = process.argv.slice(2);
	switch (command) {
		case "dev":
			return dev(rest);
		case "demo":
			return runDemo(rest);
		case "stats":
			return stats(rest);
		case "keys":
			return keys(rest);
		default:
			console.error(USAGE);
			process.exitCode = 2;
	}
}

main().catch((err: unknown) => {
	console.error(
		err instanceof TrellisError
			? `${err.code} (${err.status}): ${err.message}`
			: err instanceof Error
				? err.message
				: err,
	);
	process.exitCode = 1;
});
