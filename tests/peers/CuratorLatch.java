// A replica that elects with Apache Curator's LeaderLatch, as JVM services beside ZooKeeper
// do: one CuratorFramework with the session timeout given, a latch on the given path. Prints
// "LEADING" when the latch says it leads and "FOLLOWING" when it stops. For the ZooKeeper
// peers benchmark (tests/benches/zookeeper_peers.rs), built there with javac against Debian's
// libcurator-recipes-java.
//
// java CuratorLatch CONNECT SESSION_MS PATH ID

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.leader.LeaderLatchListener;
import org.apache.curator.retry.ExponentialBackoffRetry;

public final class CuratorLatch {
    public static void main(String[] args) throws Exception {
        CuratorFramework client = CuratorFrameworkFactory.builder()
                .connectString(args[0])
                .sessionTimeoutMs(Integer.parseInt(args[1]))
                .retryPolicy(new ExponentialBackoffRetry(100, 5))
                .build();
        client.start();
        LeaderLatch latch = new LeaderLatch(client, args[2], args[3]);
        latch.addListener(new LeaderLatchListener() {
            @Override
            public void isLeader() {
                System.out.println("LEADING");
                System.out.flush();
            }

            @Override
            public void notLeader() {
                System.out.println("FOLLOWING");
                System.out.flush();
            }
        });
        latch.start();
        Thread.sleep(Long.MAX_VALUE);
    }
}
