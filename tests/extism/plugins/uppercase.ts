// Upper-cases record values (ASCII letters). The host writes each record as
// {"key":...,"topic":...,"value":...,"headers":[...]}; an unescaped `"value":`
// cannot occur inside a JSON string, so the first one after a record's
// "topic" member is that record's value.
import { Host } from "@extism/as-pdk";
import { output, upperValue, valueEnd } from "./common";
export { abort } from "./common";

function upperValues(input: string): string {
  const parts = new Array<string>();
  let from = 0;
  while (true) {
    const topic = input.indexOf("\"topic\":", from);
    if (topic < 0) break;
    const at = input.indexOf("\"value\":", topic);
    parts.push(input.substring(from, at + 8));
    parts.push(upperValue(input, at + 8));
    from = valueEnd;
  }
  parts.push(input.substring(from));
  return parts.join("");
}

/** One record in, the same record with its value upper-cased out. */
export function transform(): i32 {
  output(upperValues(Host.inputString()));
  return 0;
}

/** The batch export: a JSON array of records in, the same array upper-cased out. */
export function transform_batch(): i32 {
  output(upperValues(Host.inputString()));
  return 0;
}
