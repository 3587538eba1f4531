// Shared by the test plugins: Extism's error_set, and ASCII upper-casing of the
// string literals that follow a given JSON member (escapes left as they are).
import { Host, Memory } from "@extism/as-pdk";

@external("extism:host/env", "error_set")
declare function error_set(offset: u64): void;

/** Fail the call with `message`: the host sees it as the plugin's error. */
export function fail(message: string): i32 {
  error_set(Memory.allocateString(message).offset);
  return 1;
}

/** Where the JSON value upper-cased by the last `upperValue` call ended. */
export let valueEnd: i32 = 0;

/** The JSON value at `start` (a string literal or null), ASCII letters upper-cased. */
export function upperValue(json: string, start: i32): string {
  if (json.charCodeAt(start) != 34) {  // null
    valueEnd = start + 4;
    return json.substring(start, valueEnd);
  }
  let escaped = false;
  let i = start + 1;
  for (; i < json.length; i++) {
    const c = json.charCodeAt(i);
    if (escaped) { escaped = false; }
    else if (c == 92) { escaped = true; }
    else if (c == 34) { break; }
  }
  valueEnd = i + 1;
  // Copy the literal (quotes included) as UTF-16 and upper-case it in place; letters
  // right after a backslash are escapes (\n, \u00e9) and stay as they are.
  const chars = new Uint16Array(valueEnd - start);
  escaped = false;
  for (let j = 0; j < chars.length; j++) {
    let c = json.charCodeAt(start + j);
    if (escaped) { escaped = false; }
    else if (c == 92) { escaped = true; }
    else if (c >= 97 && c <= 122) { c -= 32; }
    chars[j] = <u16>c;
  }
  return String.UTF16.decode(chars.buffer);
}

export function abort(message: string | null, file: string | null, line: u32, column: u32): void {
  fail("abort: " + (message == null ? "" : message));
  unreachable();
}

/** Sets the call's output to `s` as UTF-8. (`Host.outputString` of as-pdk 1.0.0 sets
 * the output length to the string's UTF-16 length, truncating non-ASCII text.) */
export function output(s: string): void {
  Host.output(Uint8Array.wrap(String.UTF8.encode(s)));
}
