/**
 * `memoJson`: a body's text seen before skips parsing, validation and
 * derivation, and gives what they gave; nothing else is remembered.
 */
import { Hono } from "hono";
import { describe, expect, it } from "vitest";
import { z } from "zod";
import { onError } from "../../functions/errors.ts";
import { memoJson } from "../../functions/validate.ts";

function app(maxChars = 1024) {
	const derived: unknown[] = [];
	const read = memoJson(
		z.object({ n: z.number() }).strict(),
		(v) => {
			derived.push(v);
			return { twice: v.n * 2 };
		},
		{ maxChars, maxBytes: 1 << 20 },
	);
	const a = new Hono();
	a.post("/", async (c) => c.json(await read(c)));
	a.onError(onError);
	const send = async (body: string, type = "application/json") => {
		const res = await a.request("/", {
			method: "POST",
			body,
			headers: { "content-type": type },
		});
		return { status: res.status, body: (await res.json()) as any };
	};
	return { derived, send };
}

describe("memoJson", () => {
	it("derives once per text, and answers the same text the same", async () => {
		const { derived, send } = app();
		expect(await send('{"n":2}')).toEqual({ status: 200, body: { twice: 4 } });
		expect(await send('{"n":2}')).toEqual({ status: 200, body: { twice: 4 } });
		expect(derived).toHaveLength(1);
		// Another text, even of the same value, is parsed on its own.
		expect(await send('{ "n": 2 }')).toEqual({
			status: 200,
			body: { twice: 4 },
		});
		expect(await send('{"n":3}')).toEqual({ status: 200, body: { twice: 6 } });
		expect(derived).toHaveLength(3);
	});

	it("refuses a bad body every time it comes, with the codes `valid` gives", async () => {
		const { derived, send } = app();
		for (let i = 0; i < 2; i++) {
			const bad = await send("{bad");
			expect([bad.status, bad.body.error.code]).toEqual([400, "invalid_json"]);
			const wrong = await send('{"n":"2"}');
			expect([wrong.status, wrong.body.error.code]).toEqual([
				400,
				"invalid_request",
			]);
			expect(wrong.body.error.message).toMatch(/^n: /);
		}
		expect(derived).toHaveLength(0);
	});

	it("does not read a body that does not say it is JSON", async () => {
		const { derived, send } = app();
		const r = await send('{"n":2}', "text/plain");
		expect([r.status, r.body.error.code]).toEqual([400, "invalid_request"]);
		expect(derived).toHaveLength(0);
		// A media type with parameters or a +json suffix is JSON.
		expect(
			(await send('{"n":2}', "application/json; charset=utf-8")).status,
		).toBe(200);
		expect((await send('{"n":2}', "application/vnd.t+json")).status).toBe(200);
	});

	it("does not remember a text longer than maxChars", async () => {
		const { derived, send } = app(8);
		const long = '{"n":  2}';
		expect(long.length).toBeGreaterThan(8);
		await send(long);
		await send(long);
		expect(derived).toHaveLength(2);
		await send('{"n":2}');
		await send('{"n":2}');
		expect(derived).toHaveLength(3);
	});
});
