/**
 * The end-to-end workloads, shared by the demo (`bin/demo.ts`) and the
 * end-to-end benchmark (`bench/e2e.ts`): what a GRPO-style trainer's agents
 * send as tool calls, generated deterministically from a seed.
 *
 * A workload is a list of groups. A group is one training step of one task:
 * `group` rollouts of the same prompt, run at once, that share a prefix of
 * calls and diverge where the policy samples differently. Epochs revisit the
 * same tasks with a sharper policy, so some paths repeat exactly and some are
 * new. Three kinds (TVCache's workload families):
 *
 * - terminal: a shell project in a container (docker when an engine runs,
 *   else a workspace directory): write the sources, build, run the tests,
 *   read files, patch, rebuild, retest. Honest about one stand-in: the
 *   "compile" checksums the sources, assembles the program and then sleeps
 *   (0.3 to 0.6 s, varying by task) where a real compiler would be working;
 *   everything else (the files, the checksums, the tests' arithmetic) is
 *   real work in the sandbox.
 * - sql: SkyRL-SQL-like agents on the Chinook database (the sqlite driver):
 *   schema exploration and SELECTs, with a few INSERTs and UPDATEs, whose
 *   reads the driver and the Worker classify as stateless on their own.
 * - rpc: a search / lookup service called as a shell command over a fixed
 *   corpus (a workspace): one setup call writes the corpus, then stateless
 *   calls (`mutates: false`). Each call sleeps 0.25 s first, standing for
 *   the network and service time of a remote search API; the search itself
 *   is a real `grep` / `awk` over the corpus.
 *
 * The runner that drives a workload through managed mode is here too
 * ({@link runManaged}); the benchmark's baseline runner, which executes the
 * same calls directly in sandboxes, is in `bench/e2e.ts`.
 */
import { performance } from "node:perf_hooks";
import type { TrellisClient } from "../client/http.ts";
import type { Template } from "../core/host-api.ts";
import type { RolloutCallResponse } from "../core/managed-api.ts";

/** One tool call as an agent sends it. */
export interface WorkloadCall {
	tool: string;
	/** A shell command (bash) or a SQL statement (sql). */
	args: { cmd: string } | { query: string };
	/** Left out: the server decides (state-changing, or the SQL rule). */
	mutates?: boolean;
}

/** One training step of one task: rollouts that run at the same time. */
export interface Group {
	/** The task's name within the workload (a runner makes it unique). */
	task: string;
	/** 1-based. */
	epoch: number;
	rollouts: WorkloadCall[][];
}

/** The workload kinds. */
export type WorkloadKind = "terminal" | "sql" | "rpc";

/** A workload: its groups, in the order a trainer would run them. */
export interface Workload {
	kind: WorkloadKind;
	/** A line saying what it is, for reports. */
	title: string;
	/** What a rollout's sandboxes start from. */
	template: Template;
	groups: Group[];
	/** What is simulated, said plainly (printed with the results). */
	standIns: string;
}

/** Options of the workload generators. */
export interface WorkloadOptions {
	/** The seed every choice is drawn from (default 1). */
	seed?: number;
	/** Distinct tasks (default 3). */
	tasks?: number;
	/** Rollouts per group (default 8, a typical GRPO group). */
	group?: number;
	/** Training steps over every task (default 2). */
	epochs?: number;
	/** Terminal workload: the sandbox driver (default docker). */
	driver?: "docker" | "workspace";
	/** Terminal workload on docker: the image template name (default the driver's base image). */
	image?: string;
}

// ------------------------------------------------------------ randomness

/** A small deterministic PRNG (mulberry32): the same seed, the same workload. */
export function rng(seed: number): () => number {
	let a = seed >>> 0;
	return () => {
		a = (a + 0x6d2b79f5) >>> 0;
		let t = a;
		t = Math.imul(t ^ (t >>> 15), t | 1);
		t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
		return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
	};
}

/** An index drawn with the given (unnormalized) weights. */
function weighted(random: () => number, weights: readonly number[]): number {
	const total = weights.reduce((s, w) => s + w, 0);
	let r = random() * total;
	for (let i = 0; i < weights.length; i++) {
		r -= weights[i];
		if (r < 0) return i;
	}
	return weights.length - 1;
}

/**
 * A policy that sharpens with training: weights of `n` options, the first
 * (the "right" one) gaining mass each epoch, as a trained policy samples
 * its best answer more often.
 */
function policy(n: number, epoch: number, spread = 1): number[] {
	const sharp = 1 + (epoch - 1) * 0.8;
	return Array.from({ length: n }, (_, i) => 1 / (1 + i * spread) ** sharp);
}

/** A different, fixed seed per (workload, task, epoch, rollout). */
function seedOf(...parts: number[]): number {
	let h = 0x811c9dc5;
	for (const p of parts) {
		h ^= p >>> 0;
		h = Math.imul(h, 0x01000193) >>> 0;
	}
	return h;
}

function defaults(o: WorkloadOptions) {
	return {
		seed: o.seed ?? 1,
		tasks: o.tasks ?? 3,
		group: o.group ?? 8,
		epochs: o.epochs ?? 2,
	};
}

/** Every group of every epoch: epochs outermost, as training steps go. */
function groupsOf(
	o: WorkloadOptions,
	kind: number,
	name: string,
	rollout: (
		task: number,
		epoch: number,
		random: () => number,
	) => WorkloadCall[],
): Group[] {
	const { seed, tasks, group, epochs } = defaults(o);
	const groups: Group[] = [];
	for (let epoch = 1; epoch <= epochs; epoch++)
		for (let task = 0; task < tasks; task++)
			groups.push({
				task: `${name}-${task}`,
				epoch,
				rollouts: Array.from({ length: group }, (_, r) =>
					rollout(task, epoch, rng(seedOf(seed, kind, task, epoch, r))),
				),
			});
	return groups;
}

// -------------------------------------------------------------- terminal

const sh = (cmd: string, mutates?: boolean): WorkloadCall => ({
	tool: "bash",
	args: { cmd },
	...(mutates === undefined ? {} : { mutates }),
});

/** The arithmetic a task's calculator gets wrong, and the candidate fixes. */
const OPS = [
	{
		name: "mul",
		bad: "a + b",
		fixes: ["a * b", "a + b + 0", "b * a + 1", "a * a"],
	},
	{
		name: "diff",
		bad: "b - a",
		fixes: ["a - b", "b - a + 0", "a + b", "1 - b"],
	},
	{
		name: "max",
		bad: "a < b ? a : b",
		fixes: ["a > b ? a : b", "a", "b", "a + b"],
	},
	{
		name: "rem",
		bad: "a / b",
		fixes: ["a % b", "int(a / b)", "b % a", "a - b"],
	},
	{
		name: "avg",
		bad: "a + b / 2",
		fixes: ["(a + b) / 2", "(a + b) * 2", "a * b / 2", "a / 2"],
	},
] as const;

/**
 * The setup call of terminal task `t`: a shell project (an awk calculator
 * with one bug, its test cases, a build script and a test script). Written
 * with one heredoc per file so the call is one shell command, as an agent's
 * `write_file` tools end up being.
 */
function terminalSetup(t: number): string {
	const bug = OPS[t % OPS.length];
	const ops = OPS.map(
		(op) =>
			`function ${op.name}(a, b) { return ${op === bug ? op.bad : op.fixes[0]} }`,
	).join("\n");
	const cases: string[] = [];
	for (let i = 1; i <= 12; i++) {
		const op = OPS[(i + t) % OPS.length];
		const a = ((i * 7 + t * 3) % 19) + 2;
		const b = ((i * 5 + t) % 7) + 1;
		const expect =
			op.name === "mul"
				? a * b
				: op.name === "diff"
					? a - b
					: op.name === "max"
						? Math.max(a, b)
						: op.name === "rem"
							? a % b
							: (a + b) / 2;
		cases.push(`${op.name} ${a} ${b} ${expect}`);
	}
	// The compile stand-in's length varies by task, as real builds do.
	const compileS = (0.3 + (t % 4) * 0.1).toFixed(1);
	return [
		`mkdir -p calc/src calc/tests calc/build`,
		`cat > calc/src/ops.awk <<'EOF'\n${ops}\nEOF`,
		`cat > calc/src/main.awk <<'EOF'
{ op = $1; a = $2 + 0; b = $3 + 0; want = $4 + 0
  if (op == "mul") got = mul(a, b); else if (op == "diff") got = diff(a, b)
  else if (op == "max") got = max(a, b); else if (op == "rem") got = rem(a, b)
  else got = avg(a, b)
  if (got == want) { pass++; print "PASS", NR, op, a, b }
  else { fail++; print "FAIL", NR, op, a, b, "want", want, "got", got } }
END { printf "%d passed, %d failed\\n", pass, fail; exit (fail > 0) }
EOF`,
		`cat > calc/tests/cases.txt <<'EOF'\n${cases.join("\n")}\nEOF`,
		// The build: real checksums and assembly, then a sleep where a
		// compiler would run (see the module comment).
		`cat > calc/build.sh <<'EOF'
set -e
cd "$(dirname "$0")"
sha256sum src/*.awk > build/sources.sha256
cat src/ops.awk src/main.awk > build/calc.awk
sleep ${compileS}
echo "built build/calc.awk from $(wc -l < build/sources.sha256) sources"
cut -c1-16 build/sources.sha256
EOF`,
		`cat > calc/test.sh <<'EOF'
cd "$(dirname "$0")"
[ -f build/calc.awk ] || { echo "not built"; exit 2; }
awk -f build/calc.awk tests/cases.txt
EOF`,
		`printf '# calc\\nAn awk calculator. sh build.sh, then sh test.sh.\\n' > calc/README`,
		`echo "project calc-${t} written"`,
	].join("\n");
}

/**
 * A terminal rollout of task `t`: shared setup and build, reads in a
 * sampled order, then one or two sampled patches, each rebuilt and
 * retested. The first candidate of a patch is the right fix.
 */
function terminalRollout(
	t: number,
	epoch: number,
	random: () => number,
): WorkloadCall[] {
	const bug = OPS[t % OPS.length];
	const calls: WorkloadCall[] = [sh(terminalSetup(t))];
	const reads = [
		sh("cat calc/README", false),
		sh("ls calc calc/src", false),
		sh("wc -l calc/tests/cases.txt", false),
		sh("head -n 3 calc/tests/cases.txt", false),
	];
	// Agents look around in different orders; reads do not move the state.
	const first = reads.splice(Math.floor(random() * reads.length), 1)[0];
	calls.push(first);
	if (random() < 0.6) calls.push(reads[Math.floor(random() * reads.length)]);
	calls.push(sh("sh calc/build.sh"));
	calls.push(sh("sh calc/test.sh", false));
	calls.push(
		random() < 0.5
			? sh(`grep -n "${bug.name}" calc/src/ops.awk`, false)
			: sh("cat calc/src/ops.awk", false),
	);
	// Candidate edits of the buggy line: the fix, then plausible wrong ones.
	const candidates = bug.fixes;
	const tries = random() < 0.35 ? 2 : 1;
	const w = policy(candidates.length, epoch);
	let last = -1;
	for (let i = 0; i < tries; i++) {
		let c = weighted(random, w);
		if (c === last) c = (c + 1) % candidates.length;
		last = c;
		const line = `function ${bug.name}(a, b) { return ${candidates[c]} }`;
		calls.push(
			sh(
				`sed -i 's|^function ${bug.name}(a, b).*$|${line}|' calc/src/ops.awk && grep -n "^function ${bug.name}" calc/src/ops.awk`,
			),
		);
		calls.push(sh("sh calc/build.sh"));
		calls.push(sh("sh calc/test.sh", false));
	}
	if (random() < 0.5)
		calls.push(sh("tail -n 1 calc/build/sources.sha256", false));
	return calls;
}

/** The terminal-like workload (see the module comment). */
export function terminalWorkload(o: WorkloadOptions = {}): Workload {
	const driver = o.driver ?? "docker";
	const template: Template =
		driver === "docker" && o.image ? { driver, name: o.image } : { driver };
	return {
		kind: "terminal",
		title: `terminal-like: a shell project built and tested in ${driver} sandboxes`,
		template,
		groups: groupsOf(o, 1, "terminal", terminalRollout),
		standIns:
			"the build sleeps 0.3-0.6 s where a compiler would run (after real checksums and assembly)",
	};
}

// ------------------------------------------------------------------- sql

const sql = (query: string): WorkloadCall => ({
	tool: "sql",
	args: { query },
});

/** The SQL tasks: what the agent explores, its candidate answers, its writes. */
const SQL_TASKS = [
	{
		// Which artists have the most tracks?
		explore: ["Artist", "Album", "Track"],
		answers: [
			"SELECT ar.Name, COUNT(*) AS n FROM Artist ar JOIN Album al ON al.ArtistId = ar.ArtistId JOIN Track t ON t.AlbumId = al.AlbumId GROUP BY ar.ArtistId ORDER BY n DESC LIMIT 5",
			"SELECT ar.Name, COUNT(al.AlbumId) AS n FROM Artist ar JOIN Album al ON al.ArtistId = ar.ArtistId GROUP BY ar.ArtistId ORDER BY n DESC LIMIT 5",
			"SELECT ArtistId, COUNT(*) AS n FROM Album GROUP BY ArtistId ORDER BY n DESC LIMIT 5",
		],
		writes: [] as string[],
	},
	{
		// Raise Rock prices by 10% and report the average price per genre.
		explore: ["Genre", "Track"],
		answers: [
			"SELECT g.Name, ROUND(AVG(t.UnitPrice), 3) AS avg FROM Track t JOIN Genre g ON g.GenreId = t.GenreId GROUP BY g.GenreId ORDER BY avg DESC LIMIT 6",
			"SELECT GenreId, AVG(UnitPrice) FROM Track GROUP BY GenreId ORDER BY 2 DESC LIMIT 6",
		],
		writes: [
			"UPDATE Track SET UnitPrice = ROUND(UnitPrice * 1.1, 2) WHERE GenreId = (SELECT GenreId FROM Genre WHERE Name = 'Rock')",
			"UPDATE Track SET UnitPrice = UnitPrice * 1.1 WHERE GenreId = 1",
		],
	},
	{
		// Add a customer with an invoice, then report revenue by country.
		explore: ["Customer", "Invoice"],
		answers: [
			"SELECT c.Country, ROUND(SUM(i.Total), 2) AS revenue FROM Invoice i JOIN Customer c ON c.CustomerId = i.CustomerId GROUP BY c.Country ORDER BY revenue DESC LIMIT 5",
			"SELECT BillingCountry, SUM(Total) FROM Invoice GROUP BY BillingCountry ORDER BY 2 DESC LIMIT 5",
			"SELECT Country, COUNT(*) FROM Customer GROUP BY Country ORDER BY 2 DESC LIMIT 5",
		],
		writes: [
			"INSERT INTO Customer (FirstName, LastName, Email, Country, SupportRepId) VALUES ('Ada', 'Lovelace', 'ada@example.com', 'United Kingdom', 3)",
			"INSERT INTO Invoice (CustomerId, InvoiceDate, BillingCountry, Total) VALUES ((SELECT MAX(CustomerId) FROM Customer), '2025-01-01', 'United Kingdom', 42.0)",
		],
	},
	{
		// Which employees sold the most, and to how many customers?
		explore: ["Employee", "Customer", "Invoice"],
		answers: [
			"SELECT e.LastName, COUNT(DISTINCT c.CustomerId) AS customers, ROUND(SUM(i.Total), 2) AS sales FROM Employee e JOIN Customer c ON c.SupportRepId = e.EmployeeId JOIN Invoice i ON i.CustomerId = c.CustomerId GROUP BY e.EmployeeId ORDER BY sales DESC",
			"SELECT SupportRepId, COUNT(*) FROM Customer GROUP BY SupportRepId",
		],
		writes: [
			"UPDATE Employee SET Title = 'Top Sales Agent' WHERE EmployeeId = 3",
		],
	},
] as const;

/**
 * A SQL rollout: look at the schema (in a sampled order), sample rows, try
 * one or two candidate answers, apply the task's writes if it has any (in a
 * sampled variant), and check the result.
 */
function sqlRollout(
	t: number,
	epoch: number,
	random: () => number,
): WorkloadCall[] {
	const task = SQL_TASKS[t % SQL_TASKS.length];
	const calls: WorkloadCall[] = [
		sql("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"),
	];
	const tables = [...task.explore];
	while (tables.length > 0) {
		const table = tables.splice(Math.floor(random() * tables.length), 1)[0];
		calls.push(sql(`PRAGMA table_info(${table})`));
		if (random() < 0.5) calls.push(sql(`SELECT * FROM ${table} LIMIT 3`));
	}
	const w = policy(task.answers.length, epoch);
	calls.push(sql(task.answers[weighted(random, w)]));
	if (task.writes.length > 0) {
		// The first write is the intended one; a rollout sometimes writes
		// a variant, or writes twice (agents retry).
		const i = weighted(random, policy(task.writes.length, epoch, 2));
		calls.push(sql(task.writes[i]));
		if (task.writes.length > 1 && random() < 0.5)
			calls.push(sql(task.writes[(i + 1) % task.writes.length]));
		calls.push(sql(task.answers[weighted(random, w)]));
	}
	if (random() < 0.4) calls.push(sql(task.answers[weighted(random, w)]));
	return calls;
}

/** The SQL workload (see the module comment). */
export function sqlWorkload(o: WorkloadOptions = {}): Workload {
	return {
		kind: "sql",
		title: "sql: SELECTs with a few INSERT/UPDATEs on Chinook (sqlite)",
		template: { driver: "sqlite", name: "chinook" },
		groups: groupsOf(o, 2, "sql", sqlRollout),
		standIns: "none: every statement runs on a copy of Chinook",
	};
}

// ------------------------------------------------------------------- rpc

const WORDS = [
	"cache",
	"graph",
	"rollout",
	"snapshot",
	"policy",
	"reward",
	"sandbox",
	"kernel",
	"tensor",
	"gradient",
	"token",
	"search",
	"index",
	"shard",
	"replica",
	"lease",
	"worker",
	"object",
	"query",
	"vector",
] as const;

/** Seconds each RPC call waits, standing for a remote service's latency. */
const RPC_LATENCY_S = "0.25";

/** Writes the corpus: 4000 documents of words picked by arithmetic (deterministic everywhere). */
function rpcSetup(t: number): string {
	const words = WORDS.join(" ");
	return [
		`mkdir -p data`,
		`awk -v t=${t} -v words="${words}" 'BEGIN { n = split(words, w, " ")`,
		`  for (i = 1; i <= 4000; i++) {`,
		`    a = w[(i * 7 + t) % n + 1]; b = w[(i * 13 + 3 * t) % n + 1]; c = w[(i * 17 + 5) % n + 1]`,
		`    printf "%d\\t%s %s\\t%s of %s for %s, part %d\\n", i, a, b, c, a, b, i % 97 } }' > data/corpus.tsv`,
		`wc -l < data/corpus.tsv`,
	].join("\n");
}

/** A stateless search or lookup against the corpus. */
function rpcQuery(t: number, q: number): WorkloadCall {
	const a = WORDS[(q * 3 + t) % WORDS.length];
	const b = WORDS[(q * 11 + 2 * t + 1) % WORDS.length];
	const cmd =
		q % 3 === 2
			? `sleep ${RPC_LATENCY_S}; awk -F'\\t' '$1 == ${(q * 389 + t * 7) % 4000}' data/corpus.tsv`
			: `sleep ${RPC_LATENCY_S}; grep -iw "${a}" data/corpus.tsv | grep -iw "${b}" | head -n 5; grep -icw "${a}" data/corpus.tsv`;
	return { tool: "bash", args: { cmd }, mutates: false };
}

/**
 * An RPC rollout: the corpus once, then searches and lookups drawn from a
 * Zipf-like distribution over the task's queries (popular ones repeat).
 */
function rpcRollout(
	t: number,
	epoch: number,
	random: () => number,
): WorkloadCall[] {
	const calls: WorkloadCall[] = [{ tool: "bash", args: { cmd: rpcSetup(t) } }];
	const queries = 16;
	const w = policy(queries, epoch, 0.6);
	const n = 6 + Math.floor(random() * 4);
	for (let i = 0; i < n; i++) calls.push(rpcQuery(t, weighted(random, w)));
	return calls;
}

/** The stateless RPC-like workload (see the module comment). */
export function rpcWorkload(o: WorkloadOptions = {}): Workload {
	return {
		kind: "rpc",
		title: "rpc: stateless search/lookup calls over a fixed corpus (workspace)",
		template: { driver: "workspace" },
		groups: groupsOf(o, 3, "rpc", rpcRollout),
		standIns: `each call sleeps ${RPC_LATENCY_S} s first, standing for a remote service's latency`,
	};
}

/** A workload by kind. */
export function workload(
	kind: WorkloadKind,
	o: WorkloadOptions = {},
): Workload {
	switch (kind) {
		case "terminal":
			return terminalWorkload(o);
		case "sql":
			return sqlWorkload(o);
		case "rpc":
			return rpcWorkload(o);
	}
}

/** How many calls a workload sends. */
export function callCount(w: Workload): number {
	return w.groups.reduce(
		(s, g) => s + g.rollouts.reduce((n, r) => n + r.length, 0),
		0,
	);
}

// ---------------------------------------------------------- managed runs

/** One call of a managed run, as the trainer saw it. */
export interface ManagedCall {
	task: string;
	epoch: number;
	rollout: number;
	/** Position of the call in its rollout. */
	index: number;
	hit: boolean;
	coalesced: boolean;
	/** The call's recorded execution time (what running it costs). */
	execMs: number;
	/** The server's time for the call, replay included. */
	tookMs: number;
	/** The round trip the trainer waited, HTTP included. */
	wallMs: number;
	plan: RolloutCallResponse["plan"];
}

/** Options of {@link runManaged}. */
export interface ManagedRunOptions {
	/** Prepended to task names so a run starts from an empty cache. */
	prefix: string;
	/** Oracle mode on every rollout (each hit re-executed and compared). */
	oracle?: boolean;
	/** Called after every call (progress). */
	onCall?: (call: ManagedCall) => void;
	/** Called when a group starts (progress labels). */
	onGroup?: (group: Group, index: number) => void;
}

/** The unique task name a run gives a workload task. */
export function runTask(prefix: string, task: string): string {
	return `${prefix}-${task}`;
}

/**
 * Runs a workload through managed mode: group after group, the rollouts of
 * a group at once (each one's calls in order), as a trainer's step does.
 * Every rollout is closed, even when a call fails.
 */
export async function runManaged(
	client: TrellisClient,
	w: Workload,
	options: ManagedRunOptions,
): Promise<ManagedCall[]> {
	const out: ManagedCall[] = [];
	for (const [gi, g] of w.groups.entries()) {
		options.onGroup?.(g, gi);
		const task = runTask(options.prefix, g.task);
		await Promise.all(
			g.rollouts.map(async (calls, r) => {
				const opened = await client.openRollout(task, {
					template: w.template,
					...(options.oracle ? { oracle: true } : {}),
				});
				try {
					for (const [index, call] of calls.entries()) {
						const t0 = performance.now();
						const res = await client.rolloutCall(task, opened.id, call);
						const done: ManagedCall = {
							task: g.task,
							epoch: g.epoch,
							rollout: r,
							index,
							hit: res.hit,
							coalesced: res.coalesced,
							execMs: res.execMs,
							tookMs: res.tookMs,
							wallMs: performance.now() - t0,
							plan: res.plan,
						};
						out.push(done);
						options.onCall?.(done);
					}
				} finally {
					await client.closeRollout(task, opened.id);
				}
			}),
		);
	}
	return out;
}

// -------------------------------------------------------------- figures

/** The value at quantile `q` (0..1) of `values` (nearest rank). */
export function quantile(values: readonly number[], q: number): number {
	if (values.length === 0) return 0;
	const sorted = [...values].sort((a, b) => a - b);
	const rank = Math.ceil(q * sorted.length) - 1;
	return sorted[Math.min(sorted.length - 1, Math.max(0, rank))];
}

/**
 * A progress counter on stderr: a bar redrawn in place on a terminal, a
 * line every tenth of the way otherwise (logs, CI, tests).
 */
export function progress(total: number, label = "calls") {
	const tty = process.stderr.isTTY === true;
	let done = 0;
	let lastTenth = -1;
	let note = "";
	const draw = () => {
		const share = total === 0 ? 1 : done / total;
		if (tty) {
			const width = 28;
			const full = Math.round(share * width);
			process.stderr.write(
				`\r[${"#".repeat(full)}${".".repeat(width - full)}] ${done}/${total} ${label} ${note}`.padEnd(
					90,
				),
			);
		} else {
			const tenth = Math.floor(share * 10);
			if (tenth !== lastTenth) {
				lastTenth = tenth;
				process.stderr.write(`${done}/${total} ${label} ${note}\n`);
			}
		}
	};
	return {
		tick(n = 1) {
			done += n;
			draw();
		},
		label(text: string) {
			note = text;
			if (tty) draw();
		},
		end() {
			if (tty) process.stderr.write("\n");
		},
	};
}
