/**
 * `jsonText` and `parseJson` read a body as `valid("json", schema)` does:
 * the same codes for the same bad bodies, and a body that does not say it
 * is JSON is not read.
 */
import { Hono } from "hono";
import { describe, expect, it } from "vitest";
import { z } from "zod";
import { LookupRequest, RecordRequest, firstIssue } from "../../core/api.ts";
import { ExecRequest } from "../../core/host-api.ts";
import { RolloutCallRequest } from "../../core/managed-api.ts";
import { onError } from "../../functions/errors.ts";
import { jsonText, parseJson, valid } from "../../functions/validate.ts";

const Schema = z.object({ n: z.number() }).strict();
const app = new Hono();
app.post("/text", async (c) => c.json(parseJson(Schema, await jsonText(c))));
app.post("/valid", valid("json", Schema), (c) => c.json(c.req.valid("json")));
app.onError(onError);

async function send(route: string, body: string, type = "application/json") {
	const res = await app.request(route, {
		method: "POST",
		body,
		headers: { "content-type": type },
	});
	const json = (await res.json()) as any;
	return { status: res.status, code: json.error?.code, body: json };
}

describe("jsonText and parseJson", () => {
	it.each([
		["a valid body", '{"n":2}', "application/json", 200, undefined],
		["malformed JSON", "{bad", "application/json", 400, "invalid_json"],
		["a wrong type", '{"n":"2"}', "application/json", 400, "invalid_request"],
		[
			"an unknown key",
			'{"n":2,"m":1}',
			"application/json",
			400,
			"invalid_request",
		],
		[
			"a body that is not said to be JSON",
			'{"n":2}',
			"text/plain",
			400,
			"invalid_request",
		],
		[
			"a media type with parameters",
			'{"n":2}',
			"application/json; charset=utf-8",
			200,
			undefined,
		],
		["a +json media type", '{"n":2}', "application/vnd.t+json", 200, undefined],
	])("answer %s as valid() does", async (_what, body, type, status, code) => {
		const viaText = await send("/text", body, type);
		const viaValid = await send("/valid", body, type);
		expect([viaText.status, viaText.code]).toEqual([status, code]);
		expect([viaValid.status, viaValid.code]).toEqual([status, code]);
		if (status === 200) expect(viaText.body).toEqual({ n: 2 });
	});

	it("names the field that is wrong", async () => {
		const r = await send("/text", '{"n":"2"}');
		expect(r.body.error.message).toMatch(/^n: /);
	});
});

// JSON.parse reads 1e400 as Infinity: a value with no JSON form, which the
// ids' canonical JSON cannot hash. Every schema that takes a call refuses it.
describe("a call's args", () => {
	const ROOT = "e".repeat(64);
	const schemas = (args: string) =>
		[
			[LookupRequest, `{"history":[],"call":{"tool":"t","args":${args}}}`],
			[
				LookupRequest,
				`{"history":[{"tool":"t","args":${args}}],"call":{"tool":"t"}}`,
			],
			[
				RecordRequest,
				`{"from":"${ROOT}","calls":[{"tool":"t","args":${args},"output":"","execMs":1}]}`,
			],
			[RolloutCallRequest, `{"tool":"t","args":${args}}`],
			[ExecRequest, `{"call":{"tool":"t","args":${args}}}`],
		] as const;

	it.each(["1e400", "-1e400", '{"a":[0,1e999]}'])(
		"are refused when they hold a number out of range: %s",
		(args) => {
			for (const [schema, body] of schemas(args)) {
				const r = schema.safeParse(JSON.parse(body));
				expect(r.success, body).toBe(false);
				expect(firstIssue(r.error!), body).toMatch(/out of range/);
			}
		},
	);

	it.each(["1e308", "-0", "0.1", '{"a":[1,2.5e-300]}'])(
		"are taken when every number is finite: %s",
		(args) => {
			for (const [schema, body] of schemas(args))
				expect(schema.safeParse(JSON.parse(body)).success, body).toBe(true);
		},
	);
});
