/*
 * The Apache Kafka Java client, driven from kiproxy's tests (tests/support/java_client.py
 * compiles this one file with javac against the kafka-clients jar of `make kafka`).
 *
 *   produce --bootstrap B --topic T --count N [--compression C] [--acks A] [--idempotent]
 *           [--transactional-id X [--abort]] [--header k=v ...] [--value-prefix P]
 *           [--key-prefix K] [--delivery-timeout-ms MS]
 *   consume --bootstrap B --topic T --count N [--isolation read_committed]
 *           [--group G [--group-protocol classic|consumer]] [--timeout-ms MS]
 *
 * Output: one JSON object a line on stdout, so a test reads exactly what the client saw:
 *   {"event":"delivered","index":0,"topic":..,"partition":..,"offset":..,"timestamp":..}
 *   {"event":"error","index":0,"error":"<exception class>","message":..,"cause":..}
 *   {"event":"record","topic":..,"partition":..,"offset":..,"timestamp":..,"key":..,
 *    "value":..,"headers":[["k","v"],...]}       (strings are UTF-8 decoded; null stays null)
 *   {"event":"done",...}                          last line; exit status 0 when every record
 *                                                 was delivered or consumed, 1 otherwise,
 *                                                 2 for a usage error.
 * Logging (log4j2) goes to stderr.
 */

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicInteger;

import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class KiproxyClient {

    private KiproxyClient() {}

    public static void main(String[] argv) {
        if (argv.length == 0) {
            usage("a subcommand: produce or consume");
        }
        Args args = new Args(argv);
        int status;
        switch (argv[0]) {
            case "produce":
                status = produce(args);
                break;
            case "consume":
                status = consume(args);
                break;
            default:
                usage("produce or consume, not " + argv[0]);
                return;
        }
        System.out.flush();
        System.exit(status);
    }

    // --- produce

    private static int produce(Args args) {
        String topic = args.required("--topic");
        int count = Integer.parseInt(args.required("--count"));
        String transactionalId = args.get("--transactional-id", null);
        boolean idempotent = args.flag("--idempotent") || transactionalId != null;
        boolean abort = args.flag("--abort");
        String valuePrefix = args.get("--value-prefix", "value-");
        String keyPrefix = args.get("--key-prefix", "key-");
        List<String[]> headers = new ArrayList<>();
        for (String kv : args.all("--header")) {
            int eq = kv.indexOf('=');
            if (eq < 0) {
                usage("--header takes k=v, not " + kv);
            }
            headers.add(new String[] {kv.substring(0, eq), kv.substring(eq + 1)});
        }

        Properties props = new Properties();
        props.put("bootstrap.servers", args.required("--bootstrap"));
        props.put("compression.type", args.get("--compression", "none"));
        props.put("acks", args.get("--acks", "all"));
        // Kafka 3+ producers are idempotent by default; the test says which it wants.
        props.put("enable.idempotence", Boolean.toString(idempotent));
        props.put("delivery.timeout.ms", args.get("--delivery-timeout-ms", "30000"));
        props.put("request.timeout.ms", "10000");
        props.put("linger.ms", "5");
        props.put("client.id", "kiproxy-java-client");
        if (transactionalId != null) {
            props.put("transactional.id", transactionalId);
        }

        AtomicInteger delivered = new AtomicInteger();
        AtomicInteger failed = new AtomicInteger();
        boolean transactionFailed = false;
        try (KafkaProducer<byte[], byte[]> producer =
                new KafkaProducer<>(props, new ByteArraySerializer(), new ByteArraySerializer())) {
            try {
                if (transactionalId != null) {
                    producer.initTransactions();
                    producer.beginTransaction();
                }
                for (int i = 0; i < count; i++) {
                    ProducerRecord<byte[], byte[]> record = new ProducerRecord<>(
                            topic, utf8(keyPrefix + i), utf8(valuePrefix + i));
                    for (String[] h : headers) {
                        record.headers().add(h[0], utf8(h[1]));
                    }
                    final int index = i;
                    producer.send(record, (meta, error) -> {
                        if (error == null) {
                            delivered.incrementAndGet();
                            emit(json("event", "delivered", "index", index, "topic", meta.topic(),
                                    "partition", meta.partition(), "offset", meta.offset(),
                                    "timestamp", meta.timestamp()));
                        } else {
                            failed.incrementAndGet();
                            emit(errorJson("send", index, error));
                        }
                    });
                }
                producer.flush();
                if (transactionalId != null) {
                    if (abort) {
                        producer.abortTransaction();
                    } else {
                        producer.commitTransaction();
                    }
                }
            } catch (RuntimeException e) {
                transactionFailed = true;
                emit(errorJson(transactionalId != null ? "transaction" : "send", -1, e));
                if (transactionalId != null) {
                    try {
                        producer.abortTransaction();
                    } catch (RuntimeException ignored) {
                        // The producer may be fenced or fatally failed; closing is all that is left.
                    }
                }
            }
        }
        boolean ok = delivered.get() == count && failed.get() == 0 && !transactionFailed;
        emit(json("event", "done", "sent", count, "delivered", delivered.get(),
                "errors", failed.get() + (transactionFailed ? 1 : 0),
                "transaction", transactionalId == null ? null : (abort ? "aborted" : "committed")));
        return ok ? 0 : 1;
    }

    // --- consume

    private static int consume(Args args) {
        String topic = args.required("--topic");
        int count = Integer.parseInt(args.required("--count"));
        String group = args.get("--group", null);
        long timeoutMs = Long.parseLong(args.get("--timeout-ms", "30000"));

        Properties props = new Properties();
        props.put("bootstrap.servers", args.required("--bootstrap"));
        props.put("isolation.level", args.get("--isolation", "read_uncommitted"));
        props.put("auto.offset.reset", "earliest");
        props.put("client.id", "kiproxy-java-client");
        if (group != null) {
            props.put("group.id", group);
            props.put("group.protocol", args.get("--group-protocol", "consumer"));
        } else {
            props.put("enable.auto.commit", "false");
        }

        int seen = 0;
        try (KafkaConsumer<byte[], byte[]> consumer =
                new KafkaConsumer<>(props, new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            long deadline = System.currentTimeMillis() + timeoutMs;
            if (group != null) {
                consumer.subscribe(List.of(topic));
            } else {
                // No group: read every partition from the beginning.
                List<TopicPartition> partitions = new ArrayList<>();
                for (PartitionInfo p : consumer.partitionsFor(topic, Duration.ofMillis(timeoutMs))) {
                    partitions.add(new TopicPartition(topic, p.partition()));
                }
                consumer.assign(partitions);
                consumer.seekToBeginning(partitions);
            }
            while (seen < count && System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<byte[], byte[]> r : consumer.poll(Duration.ofMillis(200))) {
                    List<Object> hs = new ArrayList<>();
                    for (Header h : r.headers()) {
                        hs.add(Arrays.asList(h.key(), str(h.value())));
                    }
                    emit(json("event", "record", "topic", r.topic(), "partition", r.partition(),
                            "offset", r.offset(), "timestamp", r.timestamp(), "key", str(r.key()),
                            "value", str(r.value()), "headers", hs));
                    seen++;
                }
            }
            if (group != null && seen > 0) {
                consumer.commitSync();
            }
        } catch (RuntimeException e) {
            emit(errorJson("consume", -1, e));
            emit(json("event", "done", "count", seen));
            return 1;
        }
        emit(json("event", "done", "count", seen));
        return seen >= count ? 0 : 1;
    }

    // --- output

    private static synchronized void emit(String line) {
        System.out.println(line);
    }

    private static String errorJson(String stage, int index, Throwable e) {
        Throwable cause = e.getCause();
        return json("event", "error", "stage", stage, "index", index,
                "error", e.getClass().getName(), "message", e.getMessage(),
                "cause", cause == null ? null : cause.getClass().getName(),
                "cause_message", cause == null ? null : cause.getMessage());
    }

    /** A JSON object from alternating keys and values (String, Number, Boolean, List, null). */
    private static String json(Object... keysAndValues) {
        StringBuilder sb = new StringBuilder("{");
        for (int i = 0; i < keysAndValues.length; i += 2) {
            if (i > 0) {
                sb.append(',');
            }
            value(sb, keysAndValues[i]);
            sb.append(':');
            value(sb, keysAndValues[i + 1]);
        }
        return sb.append('}').toString();
    }

    private static void value(StringBuilder sb, Object v) {
        if (v == null) {
            sb.append("null");
        } else if (v instanceof Number || v instanceof Boolean) {
            sb.append(v);
        } else if (v instanceof List) {
            sb.append('[');
            boolean first = true;
            for (Object item : (List<?>) v) {
                if (!first) {
                    sb.append(',');
                }
                first = false;
                value(sb, item);
            }
            sb.append(']');
        } else {
            String s = v.toString();
            sb.append('"');
            for (int i = 0; i < s.length(); i++) {
                char c = s.charAt(i);
                switch (c) {
                    case '"': sb.append("\\\""); break;
                    case '\\': sb.append("\\\\"); break;
                    case '\n': sb.append("\\n"); break;
                    case '\r': sb.append("\\r"); break;
                    case '\t': sb.append("\\t"); break;
                    default:
                        if (c < 0x20) {
                            sb.append(String.format("\\u%04x", (int) c));
                        } else {
                            sb.append(c);
                        }
                }
            }
            sb.append('"');
        }
    }

    private static byte[] utf8(String s) {
        return s.getBytes(StandardCharsets.UTF_8);
    }

    private static String str(byte[] b) {
        return b == null ? null : new String(b, StandardCharsets.UTF_8);
    }

    private static void usage(String what) {
        System.err.println("KiproxyClient: expected " + what + " (see the comment at the top of"
                + " tests/java/KiproxyClient.java)");
        System.exit(2);
    }

    /** --name value options; a name may repeat (--header); flags take no value. */
    private static final class Args {
        private static final List<String> FLAGS = List.of("--idempotent", "--abort");
        private final Map<String, List<String>> values = new HashMap<>();

        Args(String[] argv) {
            for (int i = 1; i < argv.length; i++) {
                String name = argv[i];
                if (!name.startsWith("--")) {
                    usage("an option, not " + name);
                }
                if (FLAGS.contains(name)) {
                    values.computeIfAbsent(name, k -> new ArrayList<>()).add("true");
                } else if (i + 1 < argv.length) {
                    values.computeIfAbsent(name, k -> new ArrayList<>()).add(argv[++i]);
                } else {
                    usage("a value after " + name);
                }
            }
        }

        String get(String name, String fallback) {
            List<String> v = values.get(name);
            return v == null ? fallback : v.get(v.size() - 1);
        }

        String required(String name) {
            String v = get(name, null);
            if (v == null) {
                usage(name);
            }
            return v;
        }

        boolean flag(String name) {
            return values.containsKey(name);
        }

        List<String> all(String name) {
            return values.getOrDefault(name, List.of());
        }
    }
}
