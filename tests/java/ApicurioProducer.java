/*
 * A producer that serializes Avro records with Apicurio Registry's own Java serde
 * (io.apicurio:apicurio-registry-serdes-avro-serde, resolved by apicurio-registry/serdes.sh)
 * and sends them with the Apache Kafka Java client. tests/support/apicurio_producer.py
 * compiles this one file against the serde's jars and the kafka-clients of `make kafka`.
 *
 *   --bootstrap B --topic T --registry URL --schema FILE [--serde k=v ...] KIND:JSON ...
 *
 * --registry is Apicurio's native API (.../apis/registry/v2), the one its serde talks to;
 * --serde sets any serde property (apicurio.registry.use-id=contentId, ...). Each KIND:JSON
 * argument is one record, its value the JSON (Avro's JSON encoding) read with the schema,
 * serialized by AvroKafkaSerializer.serialize(topic, headers, record) - what KafkaProducer
 * calls for a value serializer - then, by KIND:
 *   good        sent as the serde wrote it (raw Avro binary, the schema id in a header)
 *   unknown-id  every 8-byte apicurio.*Id header replaced by 987654321
 *   cut         the last 4 bytes of the payload dropped (it no longer decodes)
 * Each record is sent and flushed on its own, so it is one batch of one Produce request.
 *
 * Output, one JSON object a line on stdout (bytes as base64):
 *   {"event":"sent","index":0,"kind":"good","value":"..","headers":[["k",".."],...]}
 *   {"event":"delivered","index":0,"offset":5}
 *   {"event":"error","index":0,"error":"<exception class>","message":".."}
 *   {"event":"done","delivered":N,"failed":M}   exit status 0 when every record was delivered
 */

import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Base64;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicInteger;

import io.apicurio.registry.serde.avro.AvroKafkaSerializer;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.DecoderFactory;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class ApicurioProducer {

    private static final long UNKNOWN_ID = 987654321L;

    private ApicurioProducer() {}

    public static void main(String[] argv) throws Exception {
        Map<String, String> opts = new HashMap<>();
        Map<String, Object> serde = new HashMap<>();
        List<String> specs = new ArrayList<>();
        for (int i = 0; i < argv.length; i++) {
            String arg = argv[i];
            if (arg.equals("--serde")) {
                String[] kv = argv[++i].split("=", 2);
                serde.put(kv[0], kv[1]);
            } else if (arg.startsWith("--")) {
                opts.put(arg.substring(2), argv[++i]);
            } else {
                specs.add(arg);
            }
        }
        String topic = opts.get("topic");
        Schema schema = new Schema.Parser().parse(Files.readString(Path.of(opts.get("schema"))));
        serde.put("apicurio.registry.url", opts.get("registry"));
        serde.put("apicurio.registry.auto-register", "true");

        Properties props = new Properties();
        props.put("bootstrap.servers", opts.get("bootstrap"));
        props.put("acks", "all");
        props.put("linger.ms", "0");
        props.put("enable.idempotence", "false");
        props.put("delivery.timeout.ms", "20000");
        props.put("request.timeout.ms", "10000");
        AtomicInteger delivered = new AtomicInteger();
        AtomicInteger failed = new AtomicInteger();
        try (AvroKafkaSerializer<GenericRecord> serializer = new AvroKafkaSerializer<>();
             KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(
                     props, new ByteArraySerializer(), new ByteArraySerializer())) {
            serializer.configure(serde, false);
            for (int index = 0; index < specs.size(); index++) {
                String[] spec = specs.get(index).split(":", 2);
                GenericRecord record = new GenericDatumReader<GenericRecord>(schema).read(
                        null, DecoderFactory.get().jsonDecoder(schema, spec[1]));
                RecordHeaders headers = new RecordHeaders();
                byte[] value = serializer.serialize(topic, headers, record);
                value = tamper(spec[0], headers, value);
                System.out.println("{\"event\":\"sent\",\"index\":" + index + ",\"kind\":"
                        + quote(spec[0]) + ",\"value\":" + b64(value) + ",\"headers\":"
                        + headersJson(headers) + "}");
                final int i = index;
                producer.send(new ProducerRecord<>(topic, 0, (byte[]) null, value, headers),
                        (meta, error) -> {
                            if (error == null) {
                                delivered.incrementAndGet();
                                print("{\"event\":\"delivered\",\"index\":" + i + ",\"offset\":"
                                        + meta.offset() + "}");
                            } else {
                                failed.incrementAndGet();
                                print("{\"event\":\"error\",\"index\":" + i + ",\"error\":"
                                        + quote(error.getClass().getName()) + ",\"message\":"
                                        + quote(String.valueOf(error.getMessage())) + "}");
                            }
                        });
                producer.flush();
            }
        }
        print("{\"event\":\"done\",\"delivered\":" + delivered + ",\"failed\":" + failed + "}");
        System.exit(failed.get() == 0 ? 0 : 1);
    }

    private static byte[] tamper(String kind, RecordHeaders headers, byte[] value) {
        switch (kind) {
            case "good":
                return value;
            case "unknown-id":
                Header[] all = headers.toArray();
                for (Header header : all) {
                    headers.remove(header.key());
                }
                for (Header header : all) {  // the same headers, in the same order
                    boolean id = header.key().startsWith("apicurio.")
                            && header.key().endsWith("Id") && header.value().length == 8;
                    headers.add(header.key(), id
                            ? ByteBuffer.allocate(8).putLong(UNKNOWN_ID).array()
                            : header.value());
                }
                return value;
            case "cut":
                return Arrays.copyOf(value, value.length - 4);
            default:
                throw new IllegalArgumentException("record kind " + kind
                        + ": expected good, unknown-id or cut");
        }
    }

    private static synchronized void print(String line) {
        System.out.println(line);
        System.out.flush();
    }

    private static String b64(byte[] bytes) {
        return bytes == null ? "null" : quote(Base64.getEncoder().encodeToString(bytes));
    }

    private static String headersJson(RecordHeaders headers) {
        StringBuilder out = new StringBuilder("[");
        for (Header header : headers.toArray()) {
            if (out.length() > 1) {
                out.append(',');
            }
            out.append('[').append(quote(header.key())).append(',').append(b64(header.value()))
                    .append(']');
        }
        return out.append(']').toString();
    }

    private static String quote(String text) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }
}
