// Replaces every record's value with the plugin config value "greeting".
import { Config, Host } from "@extism/as-pdk";
import { fail, output, valueEnd, upperValue } from "./common";
export { abort } from "./common";

export function transform(): i32 {
  const greeting = Config.get("greeting");
  if (greeting == null) return fail("config value greeting is not set");
  const input = Host.inputString();
  const at = input.indexOf("\"value\":", input.indexOf("\"topic\":"));
  upperValue(input, at + 8);  // finds where the value ends
  output(input.substring(0, at + 8) + "\"" + greeting + "\"" + input.substring(valueEnd));
  return 0;
}
