// The "stop shouting" validator: a record whose value is all upper case is refused.
import { Host } from "@extism/as-pdk";
import { fail, output, upperValue } from "./common";
export { abort } from "./common";

export function transform(): i32 {
  const input = Host.inputString();
  const at = input.indexOf("\"value\":", input.indexOf("\"topic\":"));
  const value = input.substring(at + 8);
  if (value.startsWith("\"") && value.length > 2) {
    const literal = upperValue(input, at + 8);
    if (literal == input.substring(at + 8, at + 8 + literal.length)) {
      return fail("stop shouting, you are hurting my ears");
    }
  }
  output(input);
  return 0;
}
