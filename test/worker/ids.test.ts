import { describe, expect, it } from "vitest";
import {
	ROOT_ID,
	callKey,
	canonicalCall,
	pathIds,
	type Call,
} from "../../core/ids.ts";
import vectors from "../vectors/ids.json";
import canonicalize from "canonicalize";

describe("canonical ids", () => {
	it("derives the root from its fixed string", () => {
		expect(ROOT_ID).toBe(vectors.root);
	});

	it.each(vectors.calls.map((v, i) => [i, v] as const))(
		"reproduces call vector %i: canonical JSON and key",
		(_i, v) => {
			expect(canonicalCall(v.call)).toBe(v.canonical);
			expect(callKey(v.call)).toBe(v.key);
		},
	);

	it.each(vectors.paths.map((v, i) => [i, v] as const))(
		"reproduces path vector %i",
		(_i, v) => {
			expect(pathIds(v.calls).map((s) => s.id)).toEqual(v.ids);
		},
	);

	it("ignores key order, and `mutates` is not part of the key", () => {
		const a = callKey({ tool: "t", args: { a: 1, b: [1, { d: 2, c: 3 }] } });
		const b = callKey({ tool: "t", args: { b: [1, { c: 3, d: 2 }], a: 1 } });
		expect(a).toBe(b);
		const stateless: Call = { tool: "t", args: 1, mutates: false };
		expect(callKey(stateless)).toBe(callKey({ tool: "t", args: 1 }));
	});

	// RFC 8785 section 3.2.2 and 3.2.3, the published input and output.
	it("matches RFC 8785's examples", () => {
		const input = JSON.parse(
			'{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],"string":"\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/","literals":[null,true,false]}',
		);
		expect(canonicalize(input)).toBe(
			'{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}',
		);
		const sorting = JSON.parse(
			'{"\\u20ac":"Euro Sign","\\r":"Carriage Return","\\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One","\\ud83d\\ude00":"Emoji: Grinning Face","\\u0080":"Control","\\u00f6":"Latin Small Letter O With Diaeresis"}',
		);
		expect(canonicalize(sorting)).toBe(
			'{"\\r":"Carriage Return","1":"One","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign","\ud83d\ude00":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}',
		);
	});

	it("keeps stateless calls off the state path", () => {
		const v = vectors.paths.find(
			(p) => p.calls.length === 4 && p.calls[1].mutates === false,
		)!;
		const steps = pathIds(v.calls);
		// R1 runs at the state after M1; M2's state follows M1's directly.
		expect(steps[1].state).toBe(steps[0].id);
		expect(steps[2].state).toBe(steps[0].id);
		expect(steps[3].state).toBe(steps[2].id);
	});
});
