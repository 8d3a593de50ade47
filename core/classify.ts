/**
 * Lexical analysis of SQL text: splitting it into statements and deciding,
 * without a database, whether a statement could change one.
 *
 * Both the Worker (in managed mode, to fill in `mutates` before a lookup, so
 * the ids it computes are the ones the host's driver would) and the sqlite
 * driver use this module, so it stays pure: no imports, no Node APIs.
 *
 * The classifier is deliberately conservative (invariant 1): a read that is
 * taken for a write only costs cache hits, a write taken for a read returns
 * wrong outputs. So it answers "does not mutate" only for shapes it knows,
 * and scans them for any word that could make them write.
 */

/** One lexical token of SQL text; comments and whitespace are not tokens. */
interface Token {
	/**
	 * `word`: a bare word (keyword or identifier); `string`: a `'…'` literal;
	 * `quoted`: a `"…"`, `` `…` `` or `[…]` identifier; `semi`: `;`;
	 * `other`: numbers, operators, punctuation, parameters.
	 */
	kind: "word" | "string" | "quoted" | "semi" | "other";
	/** The token's text, upper-cased for words. */
	text: string;
	start: number;
	end: number;
}

interface Lexed {
	tokens: Token[];
	/** False when a literal, quoted identifier or comment runs off the end. */
	complete: boolean;
}

// SQLite treats every byte at or above 0x80 as part of an identifier, so any
// non-ASCII character continues a word here too.
const WORD_START = /[A-Za-z_\u0080-\uffff]/;
const WORD_PART = /[A-Za-z0-9_$\u0080-\uffff]/;

/**
 * Tokenizes like SQLite's own tokenizer as far as keywords are concerned:
 * `--` and `/* *\/` comments, `'…'` strings with `''` escapes, `"…"` and
 * `` `…` `` identifiers with doubled-quote escapes, `[…]` identifiers.
 * There are no backslash escapes in SQL.
 */
function lex(sql: string): Lexed {
	const tokens: Token[] = [];
	let complete = true;
	let i = 0;
	const n = sql.length;
	while (i < n) {
		const c = sql[i]!;
		const start = i;
		if (/\s/.test(c)) {
			i++;
		} else if (c === "-" && sql[i + 1] === "-") {
			const eol = sql.indexOf("\n", i);
			i = eol === -1 ? n : eol + 1;
		} else if (c === "/" && sql[i + 1] === "*") {
			const close = sql.indexOf("*/", i + 2);
			// SQLite accepts a block comment that runs to the end of the text.
			i = close === -1 ? n : close + 2;
		} else if (c === "'" || c === '"' || c === "`") {
			i++;
			for (;;) {
				const close = sql.indexOf(c, i);
				if (close === -1) {
					complete = false;
					i = n;
					break;
				}
				i = close + 1;
				if (sql[i] === c) i++;
				else break;
			}
			tokens.push({
				kind: c === "'" ? "string" : "quoted",
				text: sql.slice(start, i),
				start,
				end: i,
			});
		} else if (c === "[") {
			const close = sql.indexOf("]", i);
			if (close === -1) complete = false;
			i = close === -1 ? n : close + 1;
			tokens.push({ kind: "quoted", text: sql.slice(start, i), start, end: i });
		} else if (WORD_START.test(c)) {
			while (i < n && WORD_PART.test(sql[i]!)) i++;
			tokens.push({
				kind: "word",
				text: sql.slice(start, i).toUpperCase(),
				start,
				end: i,
			});
		} else if (/[0-9]/.test(c)) {
			while (i < n && /[0-9A-Za-z_.]/.test(sql[i]!)) i++;
			tokens.push({ kind: "other", text: sql.slice(start, i), start, end: i });
		} else {
			i++;
			tokens.push({
				kind: c === ";" ? "semi" : "other",
				text: c,
				start,
				end: i,
			});
		}
	}
	return { tokens, complete };
}

/**
 * Groups tokens into statements at `;`. Inside `CREATE [TEMP] TRIGGER … BEGIN
 * … END` the body's own semicolons do not end the statement: like SQLite's
 * `sqlite3_complete()`, only a `; END ;` (or the end of the text) does.
 */
function split(tokens: Token[]): Token[][] {
	const statements: Token[][] = [];
	let current: Token[] = [];
	const isTrigger = () => {
		const w = current.map((t) => (t.kind === "word" ? t.text : ""));
		return (
			w[0] === "CREATE" &&
			(w[1] === "TRIGGER" ||
				((w[1] === "TEMP" || w[1] === "TEMPORARY") && w[2] === "TRIGGER"))
		);
	};
	for (const token of tokens) {
		if (token.kind === "semi") {
			const last = current.at(-1);
			const beforeLast = current.at(-2);
			const endsTrigger =
				last?.kind === "word" &&
				last.text === "END" &&
				beforeLast?.kind === "semi";
			if (current.length > 0 && isTrigger() && !endsTrigger) {
				current.push(token);
				continue;
			}
			if (current.length > 0) statements.push(current);
			current = [];
		} else {
			current.push(token);
		}
	}
	if (current.length > 0) statements.push(current);
	return statements;
}

/**
 * The statements in SQL text, each as written but without its terminating
 * `;` and without comments or whitespace around it. Empty statements (`;;`,
 * a comment alone) are left out.
 */
export function sqlStatements(sql: string): string[] {
	return split(lex(sql).tokens).map((s) =>
		sql.slice(s[0]!.start, s.at(-1)!.end),
	);
}

// Words that can make an otherwise reading statement write. REPLACE only
// when not a call of the `replace()` function; see `writes()`.
const WRITE_WORDS = new Set([
	"INSERT",
	"UPDATE",
	"DELETE",
	"REPLACE",
	"CREATE",
	"DROP",
	"ALTER",
	"ATTACH",
	"DETACH",
	"VACUUM",
	"REINDEX",
	"ANALYZE",
	"PRAGMA",
]);

// Pragmas that only report, whatever their argument.
const READ_PRAGMAS = new Set([
	"TABLE_INFO",
	"TABLE_XINFO",
	"TABLE_LIST",
	"INDEX_LIST",
	"INDEX_INFO",
	"INDEX_XINFO",
	"FOREIGN_KEY_LIST",
	"FOREIGN_KEY_CHECK",
	"DATABASE_LIST",
	"COLLATION_LIST",
	"FUNCTION_LIST",
	"MODULE_LIST",
	"PRAGMA_LIST",
	"COMPILE_OPTIONS",
	"INTEGRITY_CHECK",
	"QUICK_CHECK",
]);

// Pragmas that report when bare and write when given a value
// (`PRAGMA user_version` reads, `PRAGMA user_version = 3` writes).
const BARE_READ_PRAGMAS = new Set([
	"USER_VERSION",
	"APPLICATION_ID",
	"SCHEMA_VERSION",
	"DATA_VERSION",
	"PAGE_COUNT",
	"PAGE_SIZE",
	"FREELIST_COUNT",
	"ENCODING",
	"AUTO_VACUUM",
	"JOURNAL_MODE",
	"FOREIGN_KEYS",
]);

function writes(tokens: Token[]): boolean {
	return tokens.some(
		(t, i) =>
			t.kind === "word" &&
			WRITE_WORDS.has(t.text) &&
			!(t.text === "REPLACE" && tokens[i + 1]?.text === "("),
	);
}

function pragmaReads(tokens: Token[]): boolean {
	// PRAGMA [schema .] name [( arg ) | = value]
	let i = 1;
	if (tokens[i + 1]?.text === ".") i += 2;
	const name = tokens[i];
	if (name === undefined || name.kind !== "word") return false;
	if (READ_PRAGMAS.has(name.text)) return true;
	return BARE_READ_PRAGMAS.has(name.text) && tokens.length === i + 1;
}

/**
 * Whether SQL text might change the database. `false` only for one
 * statement that certainly does not: a SELECT, VALUES or `WITH … SELECT`
 * with no writing keyword anywhere outside literals and comments, an EXPLAIN,
 * or a reporting PRAGMA (`table_info`, `index_list`, a bare `user_version`,
 * …). Everything else is `true`: several statements, none, writes, ATTACH,
 * VACUUM, transactions, text that does not lex (an unclosed literal), and
 * anything unknown.
 */
export function sqlMutates(sql: string): boolean {
	const { tokens, complete } = lex(sql);
	if (!complete) return true;
	const statements = split(tokens);
	if (statements.length !== 1) return true;
	const statement = statements[0]!;
	// A parenthesized statement is a syntax error in SQLite, which changes
	// nothing either; look through the parentheses to the first word.
	let first = 0;
	while (statement[first]?.text === "(") first++;
	const head = statement[first];
	if (head?.kind !== "word") return true;
	switch (head.text) {
		case "EXPLAIN":
			// EXPLAIN [QUERY PLAN] compiles the statement and lists its
			// program or plan; it never runs it.
			return false;
		case "SELECT":
		case "VALUES":
		case "WITH":
			return writes(statement);
		case "PRAGMA":
			return !pragmaReads(statement);
		default:
			return true;
	}
}

/** The tool names the sqlite driver runs as SQL unless configured otherwise. */
export const SQL_TOOLS: readonly string[] = ["sql"];

/**
 * The SQL text in a SQL call's `args`: the string itself, or the `query`
 * (as SkyRL-SQL sends it) or `sql` field of an object, with an optional
 * numeric `timeoutMs`. Null for anything else, which the driver refuses.
 */
export function sqlOf(args: unknown): string | null {
	if (typeof args === "string") return args;
	if (args === null || typeof args !== "object" || Array.isArray(args))
		return null;
	const a = args as Record<string, unknown>;
	const query = a.query ?? a.sql;
	if (typeof query !== "string") return null;
	if (a.timeoutMs !== undefined && typeof a.timeoutMs !== "number") return null;
	return query;
}

/**
 * Whether a call changes a sqlite sandbox's state when the caller does not
 * say: the sqlite driver's default, and what the Worker fills in for a
 * managed sqlite rollout, so both derive the same ids. Calls of other tools
 * and calls the driver would refuse count as changing state.
 */
export function sqlCallMutates(
	call: { tool: string; args?: unknown },
	tools: readonly string[] = SQL_TOOLS,
): boolean {
	if (!tools.includes(call.tool)) return true;
	const sql = sqlOf(call.args);
	return sql === null || sqlMutates(sql);
}
