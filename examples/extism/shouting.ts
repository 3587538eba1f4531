// The "stop shouting" validator, an Extism plugin for the `extism` interceptor: a record
// whose value is all upper case is refused, with a message the producer sees; any other
// record is returned unchanged.
import { Host, Memory } from "@extism/as-pdk";

@external("extism:host/env", "error_set")
declare function error_set(offset: u64): void;

// The host hands over one record as compact JSON, its members in this order:
//   {"key":"k1","topic":"orders","value":"HELLO","headers":[]}
export function transform(): i32 {
  const input = Host.inputString();
  const value = input.indexOf("\"value\":", input.indexOf("\"topic\":")) + 8;
  if (isAllUpperCase(input, value)) {
    error_set(Memory.allocateString("stop shouting, you are hurting my ears").offset);
    return 1;  // refused: the host reads the message set above
  }
  Host.output(Uint8Array.wrap(String.UTF8.encode(input)));  // the record, unchanged
  return 0;
}

// Whether the JSON string at `start` has an upper-case letter and no lower-case one
// (false for null). Escapes (\n, \u00e9) are skipped.
function isAllUpperCase(json: string, start: i32): bool {
  if (json.charCodeAt(start) != 34) return false;  // null
  let upper = false;
  for (let i = start + 1; i < json.length; i++) {
    const c = json.charCodeAt(i);
    if (c == 34) break;  // the closing quote
    if (c == 92) {       // a backslash: skip \x or \uXXXX
      i += json.charCodeAt(i + 1) == 117 ? 5 : 1;
      continue;
    }
    if (c >= 97 && c <= 122) return false;  // a-z
    if (c >= 65 && c <= 90) upper = true;   // A-Z
  }
  return upper;
}

// AssemblyScript's handler of runtime errors (`--use abort=shouting/abort`): the call
// fails with the error's message instead of importing the JavaScript host's `abort`.
export function abort(message: string | null, file: string | null, line: u32, column: u32): void {
  error_set(Memory.allocateString("abort: " + (message == null ? "" : message)).offset);
  unreachable();
}
