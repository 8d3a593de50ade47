/**
 * Writes test/vectors/ids.json from core/ids.ts. The committed file is the
 * contract every client (TypeScript, Python, ...) must reproduce; regenerate it
 * only on purpose (`npx tsx test/vectors/generate.ts`), never to make a test pass.
 */
import { writeFileSync } from "node:fs";
import {
	ROOT_ID,
	callKey,
	canonicalCall,
	pathIds,
	type Call,
} from "../../core/ids.ts";

// Arguments are written as JSON text and parsed, as a server would receive them.
const calls: { tool: string; args: string | undefined }[] = [
	{ tool: "bash", args: `{"cmd":"ls -la"}` },
	{ tool: "bash", args: `{"cmd":"cat foo.py","cwd":"/repo"}` },
	{ tool: "bash", args: `{"cwd":"/repo","cmd":"cat foo.py"}` },
	{ tool: "noop", args: undefined },
	{ tool: "noop", args: "null" },
	{ tool: "", args: `""` },
	{ tool: "echo", args: `{"text":""}` },
	{ tool: "unicode", args: `{"text":"héllo wörld — 你好 😀","key":"\\u20ac"}` },
	{
		tool: "unicode-keys",
		args: `{"\\u20ac":1,"\\r":2,"\\ufb33":3,"1":4,"\\ud83d\\ude00":5,"\\u0080":6,"\\u00f6":7}`,
	},
	{
		tool: "escapes",
		args: `"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\"\\/"`,
	},
	{
		tool: "numbers",
		args: `[0, -0, -0.0, 1, -1, 1.5, 0.1, 1e21, 1e-7, 1E30, 4.50, 2e-3, 333333333.33333329, 9007199254740993, 0.000000000000000000000000001, 123456789012345680000]`,
	},
	{
		tool: "nested",
		args: `{"z":{"y":[{"b":2,"a":1},[3,{"d":null,"c":true}]],"x":false},"a":{}}`,
	},
	{ tool: "array", args: `[1,"two",[3],{"four":4},null,true]` },
	{
		tool: "sql",
		args: `{"query":"SELECT Name FROM Artist WHERE ArtistId = 1;"}`,
	},
	{ tool: "emoji-tool-😀", args: `{}` },
];

function parse(args: string | undefined): unknown {
	return args === undefined ? undefined : JSON.parse(args);
}

const M = (cmd: string): Call => ({
	tool: "bash",
	args: { cmd },
	mutates: true,
});
const R = (cmd: string): Call => ({
	tool: "bash",
	args: { cmd },
	mutates: false,
});

const paths: Call[][] = [
	[],
	[M("git clone repo")],
	[M("git clone repo"), M("make")],
	[M("M1"), R("R1"), M("M2"), R("R2")],
	[R("R1"), R("R1"), M("M1"), R("R1")],
	[R("only reads"), R("only reads again")],
	[{ tool: "noop" }, { tool: "noop", args: null, mutates: false }],
	[
		{ tool: "sql", args: { query: "CREATE TABLE t(x)" } },
		{ tool: "sql", args: { query: "INSERT INTO t VALUES (1)" } },
		{ tool: "sql", args: { query: "SELECT * FROM t" }, mutates: false },
		{ tool: "unicode", args: { text: "ünïcødé 😀" }, mutates: true },
		{ tool: "numbers", args: [1e21, -0, 0.1], mutates: false },
	],
];

const vectors = {
	root: ROOT_ID,
	calls: calls.map(({ tool, args }, i) => {
		const call = { tool, args: parse(args) };
		return {
			call: args === undefined ? { tool } : { tool, args: `@@args${i}@@` },
			canonical: canonicalCall(call),
			key: callKey(call),
		};
	}),
	paths: paths.map((p) => ({
		calls: p.map((c) => ({
			tool: c.tool,
			args: c.args ?? null,
			mutates: c.mutates ?? true,
		})),
		ids: pathIds(p).map((s) => s.id),
	})),
};

// Keep each call's arguments exactly as written (-0.0, 1E30, 9007199254740993)
// so that a client parses the same text a server would.
let text = JSON.stringify(vectors, null, "\t");
calls.forEach(({ args }, i) => {
	if (args !== undefined) text = text.replace(`"@@args${i}@@"`, args);
});
writeFileSync(new URL("./ids.json", import.meta.url), text + "\n");
console.log(
	`wrote ${vectors.calls.length} calls and ${vectors.paths.length} paths`,
);
