/**
 * A small latency-vs-rate chart as hand-written SVG: no chart library to
 * install, and the output diffs as text. Both axes are logarithmic: rates
 * double from one step to the next, and latencies span from well under a
 * millisecond (p50 of a hit) to whole seconds (p99 of an overloaded run).
 */

export interface Point {
	series: string;
	rate: number;
	p50Us: number;
	p99Us: number;
	/** Achieved requests/s; a point under 95% of `rate` is drawn hollow. */
	achieved: number;
}

const COLORS = ["#6b7280", "#2563eb", "#d97706", "#059669", "#dc2626"];
const W = 640;
const H = 400;
const M = { left: 64, right: 176, top: 52, bottom: 48 };

function esc(s: string): string {
	return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

/** 1, 2, 5 steps per decade, covering [lo, hi]. */
function ticks(lo: number, hi: number): number[] {
	const out: number[] = [];
	for (
		let d = Math.floor(Math.log10(lo));
		d <= Math.ceil(Math.log10(hi));
		d++
	) {
		for (const m of [1, 2, 5]) {
			const v = m * 10 ** d;
			if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
		}
	}
	return out;
}

function label(v: number): string {
	return v >= 1 ? String(v) : v.toPrecision(1);
}

export function renderChart(
	points: Point[],
	title: string,
	subtitle = "",
): string {
	const series = [...new Set(points.map((p) => p.series))];
	const rates = [...new Set(points.map((p) => p.rate))].sort((a, b) => a - b);
	const values = points
		.flatMap((p) => [p.p50Us, p.p99Us])
		.filter((v) => v > 0)
		.map((v) => v / 1000);
	// Snap the y range to whole 1-2-5 steps so the grid lines sit on the edges.
	const yLo = 10 ** Math.floor(Math.log10(Math.min(...values, 1)));
	const yHi = 10 ** Math.ceil(Math.log10(Math.max(...values, 1)));
	const xLo = Math.log2(rates[0] ?? 1);
	const xHi = Math.log2(rates[rates.length - 1] ?? 2);
	const pw = W - M.left - M.right;
	const ph = H - M.top - M.bottom;
	const x = (rate: number) =>
		M.left +
		(xHi > xLo ? ((Math.log2(rate) - xLo) / (xHi - xLo)) * pw : pw / 2);
	const y = (msv: number) =>
		M.top +
		ph -
		((Math.log10(Math.max(msv, yLo)) - Math.log10(yLo)) /
			(Math.log10(yHi) - Math.log10(yLo))) *
			ph;

	const out: string[] = [];
	out.push(
		`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" ` +
			`viewBox="0 0 ${W} ${H}" font-family="system-ui, sans-serif" font-size="11">`,
		`<rect width="${W}" height="${H}" fill="#ffffff"/>`,
		`<text x="${M.left}" y="20" font-size="13" font-weight="600">${esc(title)}</text>`,
		`<text x="${M.left}" y="36" fill="#4b5563">${esc(subtitle)}</text>`,
	);
	for (const t of ticks(yLo, yHi)) {
		out.push(
			`<line x1="${M.left}" x2="${M.left + pw}" y1="${y(t).toFixed(1)}" ` +
				`y2="${y(t).toFixed(1)}" stroke="#e5e7eb"/>`,
			`<text x="${M.left - 6}" y="${(y(t) + 4).toFixed(1)}" ` +
				`text-anchor="end">${label(t)}</text>`,
		);
	}
	for (const r of rates) {
		out.push(
			`<line x1="${x(r).toFixed(1)}" x2="${x(r).toFixed(1)}" y1="${M.top}" ` +
				`y2="${M.top + ph}" stroke="#f3f4f6"/>`,
			`<text x="${x(r).toFixed(1)}" y="${M.top + ph + 16}" ` +
				`text-anchor="middle">${r}</text>`,
		);
	}
	out.push(
		`<rect x="${M.left}" y="${M.top}" width="${pw}" height="${ph}" ` +
			`fill="none" stroke="#9ca3af"/>`,
		`<text x="${M.left + pw / 2}" y="${H - 10}" text-anchor="middle">` +
			`target rate (requests/s)</text>`,
		`<text transform="translate(16 ${M.top + ph / 2}) rotate(-90)" ` +
			`text-anchor="middle">latency (ms, log scale)</text>`,
	);
	series.forEach((s, i) => {
		const color = COLORS[i % COLORS.length];
		const pts = points
			.filter((p) => p.series === s)
			.sort((a, b) => a.rate - b.rate);
		for (const [key, dash] of [
			["p50Us", ""],
			["p99Us", ` stroke-dasharray="5 4"`],
		] as const) {
			const d = pts
				.map((p, j) => {
					const px = x(p.rate).toFixed(1);
					const py = y(p[key] / 1000).toFixed(1);
					return `${j === 0 ? "M" : "L"}${px} ${py}`;
				})
				.join(" ");
			out.push(
				`<path d="${d}" fill="none" stroke="${color}" stroke-width="2"${dash}/>`,
			);
			for (const p of pts) {
				const full = p.achieved >= 0.95 * p.rate;
				out.push(
					`<circle cx="${x(p.rate).toFixed(1)}" ` +
						`cy="${y(p[key] / 1000).toFixed(1)}" r="3.5" ` +
						`fill="${full ? color : "#ffffff"}" stroke="${color}" ` +
						`stroke-width="1.5"/>`,
				);
			}
		}
		const ly = M.top + 14 + i * 18;
		const lx = M.left + pw + 14;
		out.push(
			`<line x1="${lx}" x2="${lx + 22}" y1="${ly - 4}" y2="${ly - 4}" ` +
				`stroke="${color}" stroke-width="2"/>`,
			`<text x="${lx + 28}" y="${ly}">${esc(s)}</text>`,
		);
	});
	const ky = M.top + 14 + series.length * 18 + 10;
	const kx = M.left + pw + 14;
	out.push(
		`<line x1="${kx}" x2="${kx + 22}" y1="${ky - 4}" y2="${ky - 4}" ` +
			`stroke="#111827" stroke-width="2"/>`,
		`<text x="${kx + 28}" y="${ky}">p50</text>`,
		`<line x1="${kx}" x2="${kx + 22}" y1="${ky + 14}" y2="${ky + 14}" ` +
			`stroke="#111827" stroke-width="2" stroke-dasharray="5 4"/>`,
		`<text x="${kx + 28}" y="${ky + 18}">p99</text>`,
		`<circle cx="${kx + 11}" cy="${ky + 32}" r="3.5" fill="#ffffff" ` +
			`stroke="#111827" stroke-width="1.5"/>`,
		`<text x="${kx + 28}" y="${ky + 36}">under 95% of rate</text>`,
		`</svg>`,
	);
	return out.join("\n") + "\n";
}

/** The fields of bench/results/lookup.json that the chart reads. */
interface LookupResults {
	meta: { date: string; cpus: number; target: string; commit: string | null };
	options: { direct?: boolean };
	/** One per route and rate (medians over its rounds; latencies in µs). */
	lines: {
		route: string;
		rate: number;
		achieved: number;
		p50: number;
		p99: number;
	}[];
}

/** The chart of one lookup benchmark run, titled with how it was run. */
export function chartOfResults(r: LookupResults): string {
	const via =
		r.meta.target === "url"
			? "--url"
			: r.options.direct
				? "wrangler dev, direct"
				: "wrangler dev, via its proxy";
	return renderChart(
		r.lines.map((x) => ({
			series: x.route,
			rate: x.rate,
			p50Us: x.p50,
			p99Us: x.p99,
			achieved: x.achieved,
		})),
		"Exact-hit lookups vs the /healthz floor",
		`${via}; ${r.meta.cpus} cores shared with the generator; ` +
			`${r.meta.date.slice(0, 10)}` +
			(r.meta.commit ? `; commit ${r.meta.commit}` : ""),
	);
}

// Re-renders a chart from saved results, without running the benchmark:
//   npx tsx bench/chart.ts bench/results/lookup.json docs/benchmarks-lookup.svg
if (import.meta.url === `file://${process.argv[1]}`) {
	const { readFileSync, writeFileSync } = await import("node:fs");
	const [from, to] = process.argv.slice(2);
	if (!from || !to) {
		console.error("usage: tsx bench/chart.ts RESULTS.json OUT.svg");
		process.exit(2);
	}
	const results = JSON.parse(readFileSync(from, "utf8")) as LookupResults;
	writeFileSync(to, chartOfResults(results));
}
